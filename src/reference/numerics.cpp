#include "reference/numerics.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "core/fp8_scale.h"

namespace megamoe::numerics {

uint16_t bf16_bits_from_float(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if (std::isnan(v)) return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // keep sign, force quiet
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
}

float float_from_bf16_bits(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

uint8_t e4m3_from_float(float v) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(v));
  if (a >= kE4M3Max) return sign | 0x7E;  // saturate (satfinite)
  if (a < std::ldexp(1.0, -6)) {
    // Subnormal range: multiples of 2^-9. A result of 8 is the smallest
    // normal 2^-6, whose code is also 8 (exponent field 1, mantissa 0).
    const double q = std::nearbyint(a * 512.0);  // round half to even
    return sign | static_cast<uint8_t>(q);
  }
  int e;
  const double frac = std::frexp(a, &e);  // a = frac * 2^e, frac in [0.5, 1)
  int exponent = e - 1;                   // a = (2 * frac) * 2^exponent
  double m = std::nearbyint((2.0 * frac - 1.0) * 8.0);
  if (m == 8.0) {
    m = 0.0;
    ++exponent;
  }
  const int field = exponent + 7;  // in [1, 15]; a < 448 keeps (15, 7) out of reach
  return sign | static_cast<uint8_t>((field << 3) | static_cast<int>(m));
}

float float_from_e4m3(uint8_t code) {
  const bool neg = (code & 0x80) != 0;
  const int field = (code >> 3) & 0xF, m = code & 0x7;
  if (field == 0xF && m == 0x7) return std::nanf("");
  const double mag = field == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, field - 7);
  return static_cast<float>(neg ? -mag : mag);
}

uint8_t e8m0_from_exponent(int exponent) {
  return static_cast<uint8_t>(std::clamp(exponent, -127, 127) + 127);
}

float float_from_e8m0(uint8_t code) {
  if (code == 0xFF) return std::nanf("");
  return static_cast<float>(std::ldexp(1.0, static_cast<int>(code) - 127));
}

ScaleKind scale_kind(ScaleMode mode) {
  return mode == ScaleMode::kFloat32 ? ScaleKind::kFloat32 : ScaleKind::kPowerOfTwo;
}

float block_scale(float amax, ScaleKind kind) {
  if (std::isnan(amax)) return amax;
  switch (kind) {
    // Both fp8 scales are kept >= FLT_MIN: a tile of tiny subnormals would
    // otherwise get a zero scale and turn 0 / 0 into NaN. One definition with
    // the GPU quantizers: core/fp8_scale.h.
    case ScaleKind::kFloat32:
      return fp8_scale_fp32(amax);
    case ScaleKind::kPowerOfTwo:
      return fp8_scale_pow2(amax);
    case ScaleKind::kE8M0: {
      // The smallest power of two that does not saturate, clamped to E8M0's
      // range; an infinite amax takes the largest scale (E8M0 has no infinity).
      if (amax == 0.0f) return float_from_e8m0(0);
      if (std::isinf(amax)) return float_from_e8m0(e8m0_from_exponent(127));
      const double e = std::ceil(std::log2(static_cast<double>(amax) / kE4M3Max));
      return float_from_e8m0(e8m0_from_exponent(static_cast<int>(e)));
    }
  }
  return 1.0f;
}

void fake_quantize_e4m3(double* data, int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols,
                        ScaleKind kind) {
  for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
    const int64_t r1 = std::min(rows, r0 + tile_rows);
    for (int64_t c0 = 0; c0 < cols; c0 += tile_cols) {
      const int64_t c1 = std::min(cols, c0 + tile_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const float a = std::fabs(static_cast<float>(data[r * cols + c]));
          amax = std::isnan(a) || std::isnan(amax) ? std::nanf("") : std::max(amax, a);
        }
      const float s = block_scale(amax, kind);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          double& v = data[r * cols + c];
          v = static_cast<double>(round_to_e4m3(static_cast<float>(v) / s)) * static_cast<double>(s);
        }
    }
  }
}

}  // namespace megamoe::numerics
