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

// to_e4m3(v, s) for a power-of-two scale s (fp8_scale_pow2's, or a NaN or
// infinite one), given inv_s = 1 / s: v / s and v * 2^-k are the same real
// number rounded once (2^-k is exact in fp32 for every exponent
// fp8_scale_pow2 makes), and 1 / inf = 0, 1 / NaN = NaN give the division's
// zeros and NaNs. One multiply instead of a division (MUFU.RCP, 5 FFMA and a
// range check with a branch to a slow path).
__device__ __forceinline__ uint8_t to_e4m3_pow2(float v, float inv_s) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(v, inv_s), __NV_SATFINITE, __NV_E4M3));
}

}  // namespace megamoe::cuda::fp8
