// The recipe's per-tile arithmetic on the device, shared by the quantizers
// (quantize.cu) and the engine's quantising epilogues (gemm/epilogues.cuh), so
// that both produce the CPU reference's bytes and scales (core/fp8_scale.h)
// by construction. Device code only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "core/fp8_scale.h"
#include "cuda/fp8/quantize.h"

namespace megamoe::cuda::fp8 {

__device__ __forceinline__ float tile_scale(float amax, Fp8Scale kind) {
  return kind == Fp8Scale::kFloat32 ? fp8_scale_fp32(amax) : fp8_scale_pow2(amax);
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

// to_e4m3(v, s) without the division for all but a few values, given the
// tile's divisor d = E4m3Divisor(s, kind) (its reciprocal computed once):
//  - power-of-two scales: v / s and v * 2^-k are the same real number
//    rounded once (2^-k is exact in fp32 for every exponent fp8_scale_pow2
//    makes), and 1 / inf = 0, 1 / NaN = NaN give the division's zeros and
//    NaNs: the multiply alone;
//  - fp32 scales: inv = __frcp_rn(s) and y = fl(v * inv) each round once,
//    so y lies within 3 u |v / s| (u = 2^-24: 3 ulps of y's binade) of
//    fl(v / s). The conversion to e4m3 rounds monotonically, so when the
//    floats 8 bit patterns below and above y (at least 4 ulps each way, a
//    binade edge included) give the same code, fl(v / s), which lies
//    between them, gives it too. Only a y near a midpoint between two e4m3
//    values (~16 in 2^20 of the normal ones), or a non-finite y or s, takes
//    the division. tests/cpu/numerics_test.cpp checks the rule on every
//    bf16 value against every 31st bf16 amax's scale (E4M3Quotient.*; the
//    whole domain once, session 24), and the
//    quantizers' GPU tests compare bytes with the CPU reference.
struct E4m3Divisor {
  float s, inv;
  bool exact;  // inv is exactly 1 / s (power of two, or a non-finite s: 0 / NaN as the division gives)
  __device__ __forceinline__ E4m3Divisor(float scale, Fp8Scale kind) : s(scale), exact(kind == Fp8Scale::kPowerOfTwo) {
    inv = __frcp_rn(scale);
  }
  __device__ __forceinline__ uint8_t operator()(float v) const {
    const float y = __fmul_rn(v, inv);
    if (exact) return static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
    const uint32_t bits = __float_as_uint(y), a = bits & 0x7FFFFFFFu, sign = bits & 0x80000000u;
    if (a < 0x7F800000u && __float_as_uint(s) < 0x7F800000u) {  // y and s finite (s > 0)
      const float2 ends = make_float2(__uint_as_float(sign | (a > 8u ? a - 8u : 0u)), __uint_as_float(sign | (a + 8u)));
      const uint32_t codes = __nv_cvt_float2_to_fp8x2(ends, __NV_SATFINITE, __NV_E4M3);
      if ((codes & 0xFFu) == (codes >> 8)) return static_cast<uint8_t>(codes & 0xFFu);
    }
    return to_e4m3(v, s);
  }
};

}  // namespace megamoe::cuda::fp8
