// The recipe's per-tile arithmetic on the device, shared by the quantizers
// (quantize.cu) and the engine's quantising epilogues (gemm/epilogues.cuh), so
// that both produce the CPU reference's bytes and scales (core/fp8_scale.h):
// by construction, or where a division is replaced by exhaustive checks
// (tests/cpu/numerics_test.cpp, tests/gpu/gpu_numerics_test.cu). Device code only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

#include "core/fp8_scale.h"
#include "cuda/fp8/quantize.h"

namespace megamoe::cuda::fp8 {

// fp8_scale_fp32 for a bf16 amax (every amax here is a bf16 value's
// magnitude) without its division: fl(amax / 448) as y = fl(amax r), r =
// fl(1 / 448), corrected by one fma each way; bitwise fl(amax / 448) for
// every finite bf16 amax (all 32640 checked: tests/cpu/numerics_test.cpp,
// where y alone is wrong for 17468 of them).
__device__ __forceinline__ float scale_fp32_of_bf16_amax(float amax) {
  if (!(amax - amax == 0.0f)) return amax;  // NaN or infinite, as fp8_scale_fp32
  if (amax == 0.0f) return 1.0f;
  constexpr float r = 1.0f / kFp8E4M3Max;
  const float y = __fmul_rn(amax, r), e = __fmaf_rn(y, kFp8E4M3Max, -amax);
  const float s = __fmaf_rn(-e, r, y);
  return s < FLT_MIN ? FLT_MIN : s;
}

__device__ __forceinline__ float tile_scale(float amax, Fp8Scale kind) {
  return kind == Fp8Scale::kFloat32 ? scale_fp32_of_bf16_amax(amax) : fp8_scale_pow2(amax);
}

// |v| folded into a running amax; NaN wins (fmaxf alone would drop it), as in
// the CPU reference's fake_quantize_e4m3.
__device__ __forceinline__ float fold_amax(float amax, float v) {
  const float a = fabsf(v);
  return (a != a || amax != amax) ? __int_as_float(0x7FC00000) : fmaxf(amax, a);
}

// The running amax of bf16 pairs, kept on pairs (exact: the values are bf16;
// NaN propagates), then folded to one float as fold_amax would have.
__device__ __forceinline__ __nv_bfloat162 amax_pair(__nv_bfloat162 m, __nv_bfloat162 v) {
  return __hmax2_nan(m, __habs2(v));
}
__device__ __forceinline__ float amax_of_pair(__nv_bfloat162 m) {
  const float2 f = __bfloat1622float2(m);
  return fold_amax(fabsf(f.x), f.y);
}

__device__ __forceinline__ uint8_t to_e4m3(float v, float s) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(v, s), __NV_SATFINITE, __NV_E4M3));
}

// to_e4m3(v, s) for a power-of-two scale s (fp8_scale_pow2's, or a NaN or
// infinite one), given inv_s = 1 / s: v / s and v * 2^-k are the same real
// number rounded once (2^-k is exact in fp32 for every exponent
// fp8_scale_pow2 makes), and 1 / inf = 0, 1 / NaN = NaN give the division's
// zeros and NaNs. One multiply instead of a division (MUFU.RCP, FCHK, 4
// FFMA and a branch to a slow path).
__device__ __forceinline__ uint8_t to_e4m3_pow2(float v, float inv_s) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(v, inv_s), __NV_SATFINITE, __NV_E4M3));
}

// The e4m3 codes of a tile's values v / s (to_e4m3) without a division per
// value where that gives the same codes, decided once per tile:
//  - power-of-two scales: v * (1 / s) (to_e4m3_pow2's reasoning), always;
//  - fp32 scales of a finite amax >= 2^-96: with r = fl(1 / s) (once),
//    y = fl(v r), e = fl(y s - v) (one rounding: fma) and q = fl(y - e r),
//    e4m3(q) = e4m3(fl(v / s)) for every bf16 v with |v| <= amax: checked
//    exhaustively over all 1.07e9 (amax, v) bf16 pairs (q itself differs
//    from fl(v / s) in the last fp32 bit for ~0.24% of them, never across an
//    e4m3 rounding boundary; below amax 2^-96 the residual e underflows and
//    206 codes differ, so those tiles divide). tests/cpu/numerics_test.cpp
//    (E4M3Quotient) repeats the check on a sample, the quantizers' GPU tests
//    compare bytes with the CPU reference. e is formed as y s - v, and q as
//    y - e r, so that v = -0 gives q = -0 (the other signs give +0).
// Three floating-point instructions a value, where the division is MUFU.RCP,
// FCHK, 4 FFMA and a branch to a slow path each.
struct E4m3Quotients {
  float s, r;
  bool pow2, fast;
  __device__ __forceinline__ E4m3Quotients(float scale, float amax, Fp8Scale kind) {
    s = scale;
    r = __frcp_rn(scale);
    pow2 = kind == Fp8Scale::kPowerOfTwo;
    fast = pow2 || amax == 0.0f || (amax >= 0x1p-96f && amax <= FLT_MAX);  // 0: only +-0, exact
  }
  // v / s, or with fp32 scales a float whose e4m3 code is v / s's (fast tiles only).
  __device__ __forceinline__ float quotient(float v) const {
    const float y = __fmul_rn(v, r);
    if (pow2) return y;
    const float e = __fmaf_rn(y, s, -v);
    return __fmaf_rn(-e, r, y);
  }
  // The codes of 8 values, value i in byte i % 4 of word i / 4.
  __device__ __forceinline__ uint2 pack8(const float (&v)[8]) const {
    uint32_t w[2] = {0, 0};
    if (fast) {
#pragma unroll
      for (int i = 0; i < 8; i += 2)
        w[i / 4] |= static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(quotient(v[i]), quotient(v[i + 1])),
                                                                    __NV_SATFINITE, __NV_E4M3))
                    << (8 * (i % 4));
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i / 4] |= static_cast<uint32_t>(to_e4m3(v[i], s)) << (8 * (i % 4));
    }
    return make_uint2(w[0], w[1]);
  }
};

}  // namespace megamoe::cuda::fp8
