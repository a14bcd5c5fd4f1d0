// The FP8 block scales of the DeepSeek-V3 style recipes (reference/numerics.h
// states them), one definition for the CPU reference and the GPU quantizers
// (cuda/fp8/quantize.cu), so that the two agree bit for bit: by construction
// for pow2; the GPU computes the fp32 rule without the division
// (cuda/fp8/e4m3.cuh scale_fp32_of_bf16_amax), bitwise this one for every
// bf16 amax, checked exhaustively (tests/cpu/numerics_test.cpp, and on the
// device tests/gpu/gpu_numerics_test.cu).
//   fp32: s = amax / 448 in fp32, at least FLT_MIN; an all-zero tile gets 1.
//   pow2: s = 2^ceil(log2(amax / 448)), the exponent at least FLT_MIN's (-126);
//         an all-zero tile gets 1. ceil(log2 x) comes from frexp (x = m 2^e,
//         m in [0.5, 1): e - 1 when m is exactly 0.5, else e), exact for every x.
// A NaN or infinite amax is returned as the scale (the tile's values then
// turn NaN or 0, as its data deserve).
#pragma once

#include <cfloat>
#include <cmath>

#include "core/host_device.h"

namespace megamoe {

inline constexpr float kFp8E4M3Max = 448.0f;

MEGAMOE_HD float fp8_scale_fp32(float amax) {
  if (!(amax - amax == 0.0f)) return amax;  // NaN or infinite (inf - inf is NaN)
  if (amax == 0.0f) return 1.0f;
  const float s = amax / kFp8E4M3Max;
  return s < FLT_MIN ? FLT_MIN : s;
}

MEGAMOE_HD float fp8_scale_pow2(float amax) {
  if (!(amax - amax == 0.0f)) return amax;
  if (amax == 0.0f) return 1.0f;
  int e = 0;
  const double m = frexp(static_cast<double>(amax) / kFp8E4M3Max, &e);
  int c = m == 0.5 ? e - 1 : e;  // ceil(log2(amax / 448))
  if (c < FLT_MIN_EXP - 1) c = FLT_MIN_EXP - 1;
  return static_cast<float>(ldexp(1.0, c));
}

}  // namespace megamoe
