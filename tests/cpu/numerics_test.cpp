// Tests of the low-precision formats the CPU reference emulates (bf16, OCP
// e4m3, e8m0) and of block-scaled fake quantisation. Expected values come from
// the format definitions: bit layouts, ties worked out by hand, and
// brute-force nearest-value searches written here, never from the functions
// under test.
#include "core/fp8_scale.h"
#include "reference/numerics.h"
#include "testing/random_layer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace megamoe::numerics {
namespace {

float float_from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}
// 2^e, exact as a float for e in [-149, 127].
float p2(int e) { return static_cast<float>(std::ldexp(1.0, e)); }

using Rng = megamoe::testing::SeededRng;
// A float with random sign and a magnitude log-uniform in [2^lo, 2^hi).
float log_uniform(Rng& rng, int lo, int hi) {
  const double mag = std::exp2(lo + (hi - lo) * rng.unit());
  return static_cast<float>((rng.next() & 1) ? -mag : mag);
}

// ---- bf16 -------------------------------------------------------------------

// Nearest bf16 by comparing the two neighbouring bf16 values (ties to the
// even one). Past the largest finite bf16 the next value up is 2^128, which
// makes the comparison the IEEE overflow rule.
uint16_t nearest_bf16(float x) {
  const uint32_t b = bits_of(x);
  const uint32_t sign = b & 0x80000000u;
  const uint32_t lo = b & 0x7FFF0000u;  // magnitude truncated to bf16
  const uint32_t hi = lo + 0x10000u;    // next bf16 magnitude up
  const double a = std::fabs(static_cast<double>(x));
  const double vlo = static_cast<double>(float_from_bits(lo));
  const double vhi = hi == 0x7F800000u ? std::ldexp(1.0, 128) : static_cast<double>(float_from_bits(hi));
  const double dlo = a - vlo, dhi = vhi - a;
  uint32_t pick;
  if (dlo < dhi) pick = lo;
  else if (dhi < dlo) pick = hi;
  else pick = ((lo >> 16) & 1u) == 0 ? lo : hi;
  return static_cast<uint16_t>((sign | pick) >> 16);
}

TEST(Bf16, KnownValues) {
  EXPECT_EQ(bf16_bits_from_float(1.0f), 0x3F80);
  EXPECT_EQ(bf16_bits_from_float(-2.0f), 0xC000);
  EXPECT_EQ(bf16_bits_from_float(0.5f), 0x3F00);
  EXPECT_EQ(bf16_bits_from_float(3.0f), 0x4040);
  EXPECT_EQ(bf16_bits_from_float(0.0f), 0x0000);
  EXPECT_EQ(bf16_bits_from_float(-0.0f), 0x8000);
  // 1/3 = 0x3EAAAAAB: dropped half 0xAAAB > 0x8000 rounds up.
  EXPECT_EQ(bf16_bits_from_float(1.0f / 3.0f), 0x3EAB);
  // pi = 0x40490FDB: dropped half 0x0FDB < 0x8000 truncates.
  EXPECT_EQ(bf16_bits_from_float(3.14159265f), 0x4049);
  EXPECT_EQ(float_from_bf16_bits(0x3F80), 1.0f);
  EXPECT_EQ(float_from_bf16_bits(0xC040), -3.0f);
  EXPECT_EQ(round_to_bf16(1.0f / 3.0f), float_from_bits(0x3EAB0000u));
}

TEST(Bf16, ExactTiesRoundToEven) {
  // bf16 keeps 7 mantissa bits: near 1 the spacing is 2^-7, so 1 + 2^-8 is a tie
  // between 1 (even) and 1 + 2^-7 (odd) and 1 + 3*2^-8 a tie between 1 + 2^-7
  // (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(round_to_bf16(1.0f + p2(-8)), 1.0f);
  EXPECT_EQ(round_to_bf16(1.0f + 3.0f * p2(-8)), 1.0f + p2(-6));
  EXPECT_EQ(round_to_bf16(-(1.0f + p2(-8))), -1.0f);
  EXPECT_EQ(round_to_bf16(-(1.0f + 3.0f * p2(-8))), -(1.0f + p2(-6)));
  // One float ulp off a tie goes to the nearer neighbour.
  EXPECT_EQ(round_to_bf16(1.0f + p2(-8) + p2(-23)), 1.0f + p2(-7));
  EXPECT_EQ(round_to_bf16(1.0f + 3.0f * p2(-8) - p2(-23)), 1.0f + p2(-7));
  // The same tie far from 1.
  EXPECT_EQ(round_to_bf16(p2(100) * (1.0f + p2(-8))), p2(100));
  EXPECT_EQ(round_to_bf16(p2(-100) * (1.0f + 3.0f * p2(-8))), p2(-100) * (1.0f + p2(-6)));
}

TEST(Bf16, NaNStaysNaNWithItsSign) {
  // Quiet, signalling with payload only in the dropped bits, all-ones payload.
  for (uint32_t payload : {0x00400000u, 0x00000001u, 0x007FFFFFu, 0x00010000u}) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float x = float_from_bits(sign | 0x7F800000u | payload);
      ASSERT_TRUE(std::isnan(x));
      const uint16_t b = bf16_bits_from_float(x);
      EXPECT_TRUE(std::isnan(float_from_bf16_bits(b))) << std::hex << payload;
      EXPECT_EQ((b & 0x8000) != 0, sign != 0) << std::hex << payload;
      EXPECT_NE(b & 0x0040, 0) << "NaN should come out quiet";
    }
  }
}

TEST(Bf16, InfinityKeptAndOverflowRoundsToInfinity) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(bf16_bits_from_float(inf), 0x7F80);
  EXPECT_EQ(bf16_bits_from_float(-inf), 0xFF80);
  // Largest finite bf16 is 0x7F7F = (2 - 2^-7) * 2^127; the midpoint to the next
  // (virtual) value 2^128 is 0x7F7F8000, a tie that goes to even 0x7F80 = inf.
  EXPECT_EQ(bf16_bits_from_float(float_from_bits(0x7F7F0000u)), 0x7F7F);
  EXPECT_EQ(bf16_bits_from_float(float_from_bits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(bf16_bits_from_float(float_from_bits(0x7F7F8000u)), 0x7F80);
  EXPECT_EQ(bf16_bits_from_float(FLT_MAX), 0x7F80);
  EXPECT_EQ(bf16_bits_from_float(-FLT_MAX), 0xFF80);
  EXPECT_TRUE(std::isinf(round_to_bf16(FLT_MAX)));
}

TEST(Bf16, Subnormals) {
  // bf16 subnormals are the float subnormals with the low 16 bits cleared.
  EXPECT_EQ(bf16_bits_from_float(float_from_bits(0x00010000u)), 0x0001);  // 2^-133, exact
  EXPECT_EQ(bf16_bits_from_float(float_from_bits(0x00008000u)), 0x0000);  // tie 0 / 0x0001 -> even 0
  EXPECT_EQ(bf16_bits_from_float(float_from_bits(0x00018000u)), 0x0002);  // tie 0x0001 / 0x0002 -> 0x0002
  EXPECT_EQ(bf16_bits_from_float(float_from_bits(0x00008001u)), 0x0001);  // above the tie
  EXPECT_EQ(bf16_bits_from_float(float_from_bits(0x00000001u)), 0x0000);  // smallest float subnormal
  EXPECT_EQ(bf16_bits_from_float(float_from_bits(0x80008000u)), 0x8000);  // -tie -> -0
  // Rounding up the largest subnormal carries into the smallest normal, 2^-126.
  EXPECT_EQ(round_to_bf16(float_from_bits(0x007FFFFFu)), p2(-126));
}

TEST(Bf16, EveryPatternDecodesByShiftAndRoundTrips) {
  for (uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const float f = float_from_bf16_bits(static_cast<uint16_t>(b));
    ASSERT_EQ(bits_of(f), b << 16);
    if (!std::isnan(f)) {
      ASSERT_EQ(bf16_bits_from_float(f), b) << std::hex << b;
    }
  }
}

TEST(Bf16, RandomFloatsRoundToNearest) {
  Rng rng(1);
  for (int i = 0; i < (1 << 20); ++i) {
    const float x = float_from_bits(static_cast<uint32_t>(rng.next()));
    if (!std::isfinite(x)) continue;
    ASSERT_EQ(bf16_bits_from_float(x), nearest_bf16(x)) << std::hex << bits_of(x);
  }
}

// ---- e4m3 -------------------------------------------------------------------

// Magnitudes of the positive codes 0..0x7E in code order, straight from the
// OCP E4M3 definition: subnormals m * 2^-9, then (1 + m/8) * 2^e for
// e = -6..8, without S.1111.111 (NaN).
const std::vector<double>& e4m3_magnitudes() {
  static const std::vector<double> table = [] {
    std::vector<double> v;
    for (int m = 0; m < 8; ++m) v.push_back(std::ldexp(m, -9));
    for (int e = -6; e <= 8; ++e)
      for (int m = 0; m < 8; ++m)
        if (!(e == 8 && m == 7)) v.push_back(std::ldexp(1.0 + m / 8.0, e));
    return v;
  }();
  return table;
}

// Nearest e4m3 code by search over the table: ties to the even code (the even
// mantissa), saturation to 448, NaN -> 0x7F.
uint8_t nearest_e4m3(float x) {
  if (std::isnan(x)) return 0x7F;
  const std::vector<double>& t = e4m3_magnitudes();
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));
  int code;
  if (a >= 448.0) {
    code = 0x7E;
  } else {
    const int i = static_cast<int>(std::lower_bound(t.begin(), t.end(), a) - t.begin());
    if (t[i] == a) {
      code = i;
    } else {
      const double below = a - t[i - 1], above = t[i] - a;
      code = below < above ? i - 1 : above < below ? i : ((i - 1) % 2 == 0 ? i - 1 : i);
    }
  }
  return static_cast<uint8_t>(sign | code);
}
double nearest_e4m3_value(float x) {
  const uint8_t c = nearest_e4m3(x);
  const double m = e4m3_magnitudes()[c & 0x7F];
  return (c & 0x80) ? -m : m;
}

TEST(E4M3, DecodeKnownCodes) {
  EXPECT_EQ(float_from_e4m3(0x00), 0.0f);
  EXPECT_FALSE(std::signbit(float_from_e4m3(0x00)));
  EXPECT_EQ(float_from_e4m3(0x01), p2(-9));
  EXPECT_EQ(float_from_e4m3(0x07), 7.0f * p2(-9));
  EXPECT_EQ(float_from_e4m3(0x08), p2(-6));
  EXPECT_EQ(float_from_e4m3(0x38), 1.0f);
  EXPECT_EQ(float_from_e4m3(0x3C), 1.5f);
  EXPECT_EQ(float_from_e4m3(0x40), 2.0f);
  EXPECT_EQ(float_from_e4m3(0x7E), 448.0f);
  EXPECT_EQ(float_from_e4m3(0x7D), 416.0f);
  EXPECT_TRUE(std::isnan(float_from_e4m3(0x7F)));
  EXPECT_TRUE(std::isnan(float_from_e4m3(0xFF)));
  EXPECT_EQ(float_from_e4m3(0xFE), -448.0f);
  EXPECT_EQ(float_from_e4m3(0xB8), -1.0f);
  EXPECT_EQ(float_from_e4m3(0x80), 0.0f);
  EXPECT_TRUE(std::signbit(float_from_e4m3(0x80)));
}

TEST(E4M3, DecodeOfEveryCodeMatchesTheFormat) {
  const std::vector<double>& t = e4m3_magnitudes();
  ASSERT_EQ(t.size(), 127u);
  for (int c = 0; c < 256; ++c) {
    const float v = float_from_e4m3(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(std::fabs(v)), t[c & 0x7F]) << c;
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << c;
  }
  for (int c = 0; c < 0x7E; ++c)
    EXPECT_LT(float_from_e4m3(static_cast<uint8_t>(c)), float_from_e4m3(static_cast<uint8_t>(c + 1))) << c;
}

TEST(E4M3, EveryFiniteCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(e4m3_from_float(float_from_e4m3(static_cast<uint8_t>(c))), c) << c;
  }
  // -0 keeps its sign (code 0x80), as the hardware conversion does.
  EXPECT_EQ(e4m3_from_float(-0.0f), 0x80);
  EXPECT_EQ(e4m3_from_float(0.0f), 0x00);
}

TEST(E4M3, MidpointsRoundToTheEvenCode) {
  const std::vector<double>& t = e4m3_magnitudes();
  for (int c = 0; c + 1 <= 0x7E; ++c) {
    const float mid = static_cast<float>((t[c] + t[c + 1]) / 2);  // exact: few significant bits
    ASSERT_EQ(static_cast<double>(mid), (t[c] + t[c + 1]) / 2);
    const int even = c % 2 == 0 ? c : c + 1;
    EXPECT_EQ(e4m3_from_float(mid), even) << "midpoint of codes " << c << " and " << c + 1;
    EXPECT_EQ(e4m3_from_float(-mid), 0x80 | even) << c;
    // Just off the midpoint: the nearer code.
    const float inf = std::numeric_limits<float>::infinity();
    EXPECT_EQ(e4m3_from_float(std::nextafter(mid, 0.0f)), c) << c;
    EXPECT_EQ(e4m3_from_float(std::nextafter(mid, inf)), c + 1) << c;
    EXPECT_EQ(e4m3_from_float(-std::nextafter(mid, inf)), 0x80 | (c + 1)) << c;
  }
}

TEST(E4M3, SaturatesInsteadOfOverflowing) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {448.0f, 449.0f, 463.99f, 464.0f, 480.0f, 500.0f, 1e9f, FLT_MAX, inf}) {
    EXPECT_EQ(e4m3_from_float(v), 0x7E) << v;
    EXPECT_EQ(e4m3_from_float(-v), 0xFE) << v;
  }
  EXPECT_EQ(round_to_e4m3(1e9f), 448.0f);
  EXPECT_EQ(round_to_e4m3(-inf), -448.0f);
  // Between 416 and 448 ordinary rounding still applies (midpoint 432 -> even 0x7E).
  EXPECT_EQ(e4m3_from_float(431.0f), 0x7D);
  EXPECT_EQ(e4m3_from_float(432.0f), 0x7E);
}

TEST(E4M3, NaNEncodesToNaN) {
  EXPECT_EQ(e4m3_from_float(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_TRUE(std::isnan(round_to_e4m3(-std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(round_to_e4m3(float_from_bits(0x7F800001u))));  // signalling
}

TEST(E4M3, SubnormalRounding) {
  // Subnormals are multiples of 2^-9; halfway cases go to the even multiple.
  EXPECT_EQ(e4m3_from_float(p2(-10)), 0x00);          // 0.5 * 2^-9: tie 0 / 1 -> 0
  EXPECT_EQ(e4m3_from_float(3.0f * p2(-10)), 0x02);   // 1.5 * 2^-9: tie 1 / 2 -> 2
  EXPECT_EQ(e4m3_from_float(5.0f * p2(-10)), 0x02);   // 2.5 * 2^-9: tie 2 / 3 -> 2
  EXPECT_EQ(e4m3_from_float(7.0f * p2(-10)), 0x04);   // 3.5 * 2^-9: tie 3 / 4 -> 4
  EXPECT_EQ(e4m3_from_float(p2(-10) + p2(-30)), 0x01);
  EXPECT_EQ(e4m3_from_float(p2(-11)), 0x00);
  EXPECT_EQ(e4m3_from_float(-p2(-10)), 0x80);         // rounds to -0
  EXPECT_EQ(e4m3_from_float(-3.0f * p2(-10)), 0x82);
  EXPECT_EQ(e4m3_from_float(1e-30f), 0x00);
  EXPECT_EQ(e4m3_from_float(float_from_bits(1u)), 0x00);  // a float subnormal
  EXPECT_EQ(e4m3_from_float(7.0f * p2(-9)), 0x07);    // largest subnormal, exact
}

TEST(E4M3, SmallestNormalBoundary) {
  EXPECT_EQ(e4m3_from_float(p2(-6)), 0x08);
  // 7.5 * 2^-9, midpoint of the largest subnormal (odd code 7) and 2^-6 (code 8).
  const float mid = 15.0f * p2(-10);
  EXPECT_EQ(e4m3_from_float(mid), 0x08);
  EXPECT_EQ(e4m3_from_float(std::nextafter(mid, 0.0f)), 0x07);
  // 2^-6 * 17/16, midpoint of codes 8 and 9.
  EXPECT_EQ(e4m3_from_float(p2(-6) * 17.0f / 16.0f), 0x08);
  EXPECT_EQ(e4m3_from_float(p2(-6) * 17.0f / 16.0f + p2(-20)), 0x09);
  EXPECT_EQ(e4m3_from_float(std::nextafter(p2(-6), 0.0f)), 0x08);
}

TEST(E4M3, RandomFloatsRoundToNearest) {
  Rng rng(2);
  for (int i = 0; i < 200000; ++i) {
    const float x = log_uniform(rng, -13, 10);
    ASSERT_EQ(e4m3_from_float(x), nearest_e4m3(x)) << x;
  }
}

// ---- e8m0 -------------------------------------------------------------------

TEST(E8M0, EncodeClampsAndDecodeIsAPowerOfTwo) {
  EXPECT_EQ(e8m0_from_exponent(0), 127);
  EXPECT_EQ(e8m0_from_exponent(1), 128);
  EXPECT_EQ(e8m0_from_exponent(-127), 0);
  EXPECT_EQ(e8m0_from_exponent(127), 254);
  EXPECT_EQ(e8m0_from_exponent(128), 254);    // clamped: 255 is NaN
  EXPECT_EQ(e8m0_from_exponent(1000), 254);
  EXPECT_EQ(e8m0_from_exponent(-128), 0);
  EXPECT_EQ(e8m0_from_exponent(-100000), 0);
  EXPECT_EQ(float_from_e8m0(127), 1.0f);
  EXPECT_EQ(float_from_e8m0(128), 2.0f);
  EXPECT_EQ(float_from_e8m0(0), p2(-127));
  EXPECT_GT(float_from_e8m0(0), 0.0f);       // a float subnormal, not flushed
  EXPECT_EQ(float_from_e8m0(254), p2(127));
  EXPECT_TRUE(std::isnan(float_from_e8m0(255)));
  // Each code doubles the previous one.
  for (int c = 0; c < 254; ++c)
    EXPECT_EQ(float_from_e8m0(static_cast<uint8_t>(c + 1)), 2.0f * float_from_e8m0(static_cast<uint8_t>(c))) << c;
}

// ---- block scales -----------------------------------------------------------

TEST(BlockScale, Float32IsAmaxOver448) {
  EXPECT_EQ(block_scale(448.0f, ScaleKind::kFloat32), 1.0f);
  EXPECT_EQ(block_scale(896.0f, ScaleKind::kFloat32), 2.0f);
  EXPECT_EQ(block_scale(7.0f, ScaleKind::kFloat32), 1.0f / 64.0f);  // 448 = 7 * 64
  EXPECT_EQ(block_scale(1.0f, ScaleKind::kFloat32), 1.0f / 448.0f);
  EXPECT_EQ(block_scale(0.0f, ScaleKind::kFloat32), 1.0f);
}

TEST(BlockScale, NonFiniteAmaxGivesTheDocumentedScale) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isnan(block_scale(std::nanf(""), ScaleKind::kFloat32)));
  EXPECT_TRUE(std::isnan(block_scale(std::nanf(""), ScaleKind::kPowerOfTwo)));
  EXPECT_EQ(block_scale(inf, ScaleKind::kFloat32), inf);
  EXPECT_EQ(block_scale(inf, ScaleKind::kPowerOfTwo), inf);
  EXPECT_EQ(block_scale(inf, ScaleKind::kE8M0), p2(127));
}

TEST(BlockScale, PowerOfTwoIsTight) {
  EXPECT_EQ(block_scale(0.0f, ScaleKind::kPowerOfTwo), 1.0f);
  EXPECT_EQ(block_scale(448.0f, ScaleKind::kPowerOfTwo), 1.0f);
  EXPECT_EQ(block_scale(449.0f, ScaleKind::kPowerOfTwo), 2.0f);
  EXPECT_EQ(block_scale(224.0f, ScaleKind::kPowerOfTwo), 0.5f);
  EXPECT_EQ(block_scale(1.0f, ScaleKind::kPowerOfTwo), p2(-8));  // 448 / 256 = 1.75 > 1
  Rng rng(3);
  std::vector<float> amaxes;
  for (int e = -100; e <= 110; ++e) {  // 448 * 2^e and its float neighbours
    const float b = 448.0f * p2(e);
    amaxes.insert(amaxes.end(), {b, std::nextafter(b, 0.0f), std::nextafter(b, FLT_MAX)});
  }
  for (int i = 0; i < 5000; ++i) amaxes.push_back(std::fabs(log_uniform(rng, -100, 120)));
  for (float amax : amaxes) {
    const double s = block_scale(amax, ScaleKind::kPowerOfTwo);
    int e;
    ASSERT_EQ(std::frexp(s, &e), 0.5) << amax << ": scale " << s << " is not a power of two";
    EXPECT_LE(amax / s, 448.0) << amax;
    EXPECT_GT(amax / s, 224.0) << amax;
  }
}

TEST(BlockScale, E8M0IsTheNonSaturatingPowerOfTwoClamped) {
  // The header's rule: the smallest power of two s with amax <= 448 s (no
  // element saturates), its exponent clamped to E8M0's [-127, 127].
  EXPECT_EQ(block_scale(0.0f, ScaleKind::kE8M0), p2(-127));
  EXPECT_EQ(block_scale(1.0f, ScaleKind::kE8M0), p2(-8));   // 448 / 256 = 1.75 >= 1
  EXPECT_EQ(block_scale(448.0f, ScaleKind::kE8M0), 1.0f);
  EXPECT_EQ(block_scale(449.0f, ScaleKind::kE8M0), 2.0f);
  EXPECT_EQ(block_scale(511.0f, ScaleKind::kE8M0), 2.0f);   // OCP's floor rule would give 1 and saturate
  EXPECT_EQ(block_scale(896.0f, ScaleKind::kE8M0), 2.0f);
  EXPECT_EQ(block_scale(897.0f, ScaleKind::kE8M0), 4.0f);
  EXPECT_EQ(block_scale(FLT_MAX, ScaleKind::kE8M0), p2(120));  // FLT_MAX / 448 is in (2^119, 2^120]
  EXPECT_EQ(block_scale(p2(-130), ScaleKind::kE8M0), p2(-127));  // 2^-138 clamps to the smallest e8m0
  EXPECT_EQ(block_scale(448.0f * p2(-127), ScaleKind::kE8M0), p2(-127));
  EXPECT_EQ(block_scale(448.0f * p2(-128), ScaleKind::kE8M0), p2(-127));
  Rng rng(4);
  for (int i = 0; i < 5000; ++i) {
    const float amax = std::fabs(log_uniform(rng, -140, 127));
    int f = -128;
    while (448.0 * std::ldexp(1.0, f) < amax) ++f;  // smallest non-saturating exponent
    const double expect = std::ldexp(1.0, std::max(f, -127));
    EXPECT_EQ(static_cast<double>(block_scale(amax, ScaleKind::kE8M0)), expect) << amax;
  }
}

TEST(BlockScale, NaNAmaxGivesNaNAndScaleKindMapsModes) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (ScaleKind k : {ScaleKind::kFloat32, ScaleKind::kPowerOfTwo, ScaleKind::kE8M0})
    EXPECT_TRUE(std::isnan(block_scale(nan, k)));
  EXPECT_EQ(scale_kind(ScaleMode::kFloat32), ScaleKind::kFloat32);
  EXPECT_EQ(scale_kind(ScaleMode::kPowerOfTwo), ScaleKind::kPowerOfTwo);
}

// ---- fake quantisation ------------------------------------------------------

// The scale by its definition: fp32 amax / 448; or the smallest power of two
// s with amax <= 448 s (for kE8M0 clamped to 2^-127 from below).
double reference_scale(float amax, ScaleKind kind) {
  switch (kind) {
    case ScaleKind::kFloat32:
      return amax == 0.0f ? 1.0 : static_cast<double>(amax / 448.0f);
    case ScaleKind::kPowerOfTwo:
    case ScaleKind::kE8M0: {
      const int lowest = kind == ScaleKind::kE8M0 ? -127 : -160;
      if (amax == 0.0f) return kind == ScaleKind::kE8M0 ? std::ldexp(1.0, -127) : 1.0;
      int f = lowest;
      while (448.0 * std::ldexp(1.0, f) < amax) ++f;
      return std::ldexp(1.0, f);
    }
  }
  return 1.0;
}

// Fake quantisation written from the header's description, with the
// brute-force e4m3 rounding above.
std::vector<double> reference_fake_quantize(std::vector<double> d, int64_t rows, int64_t cols, int64_t tr,
                                            int64_t tc, ScaleKind kind) {
  for (int64_t r0 = 0; r0 < rows; r0 += tr)
    for (int64_t c0 = 0; c0 < cols; c0 += tc) {
      const int64_t r1 = std::min(rows, r0 + tr), c1 = std::min(cols, c0 + tc);
      float amax = 0.0f;
      bool nan = false;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const float a = std::fabs(static_cast<float>(d[r * cols + c]));
          nan = nan || std::isnan(a);
          amax = std::max(amax, a);
        }
      const float s = static_cast<float>(reference_scale(amax, kind));
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          double& v = d[r * cols + c];
          v = nan ? std::nan("") : nearest_e4m3_value(static_cast<float>(v) / s) * static_cast<double>(s);
        }
    }
  return d;
}

// Float-representable data whose magnitude varies a lot between rows and
// columns (so neighbouring tiles get very different scales), with some zeros.
std::vector<double> random_matrix(Rng& rng, int64_t rows, int64_t cols) {
  std::vector<double> d(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int lo = static_cast<int>((r * 7 + c / 16 * 3) % 20) - 10;
      d[r * cols + c] = rng.below(50) == 0 ? 0.0 : static_cast<double>(log_uniform(rng, lo - 6, lo + 2));
    }
  return d;
}

// Same values, NaN == NaN.
void expect_same(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      ASSERT_TRUE(std::isnan(got[i])) << "element " << i;
    } else {
      ASSERT_EQ(got[i], want[i]) << "element " << i;
    }
  }
}

TEST(FakeQuantize, MatchesReferenceForEveryTileShapeAndScaleKind) {
  struct Case {
    int64_t rows, cols, tile_rows, tile_cols;
  };
  const Case cases[] = {
      {3, 256, 1, 128},    // activations: 1 x 128
      {130, 200, 128, 128},  // weights: 128 x 128 with partial edge tiles
      {256, 5, 128, 1},    // 128 x 1: along columns
      {4, 96, 1, 32},      // MX: 1 x 32
      {7, 9, 4, 4},        // small tiles, partial in both directions
      {2, 50, 1, 128},     // a tile wider than the matrix
  };
  Rng rng(5);
  for (const Case& c : cases)
    for (ScaleKind kind : {ScaleKind::kFloat32, ScaleKind::kPowerOfTwo, ScaleKind::kE8M0}) {
      SCOPED_TRACE(::testing::Message() << c.rows << "x" << c.cols << " tiles " << c.tile_rows << "x"
                                        << c.tile_cols << " kind " << static_cast<int>(kind));
      const std::vector<double> in = random_matrix(rng, c.rows, c.cols);
      std::vector<double> got = in;
      fake_quantize_e4m3(got.data(), c.rows, c.cols, c.tile_rows, c.tile_cols, kind);
      expect_same(got, reference_fake_quantize(in, c.rows, c.cols, c.tile_rows, c.tile_cols, kind));
    }
}

TEST(FakeQuantize, MaxElementMapsTo448TimesScale) {
  // amax -> q = +-448 exactly, so the output is 448 * fl(amax / 448): amax up
  // to the one rounding of the fp32 scale, and exact when amax / 448 is a float.
  for (float amax : {1.0f, 3.3f, 448.0f, 1e-3f, 12345.678f, 0.1f, 7.0f * p2(-20)}) {
    std::vector<double> d(128);
    for (int i = 0; i < 128; ++i) d[i] = static_cast<double>(amax) * (i + 1) / 256.0;  // all below amax
    d[37] = -static_cast<double>(amax);
    fake_quantize_e4m3(d.data(), 1, 128, 1, 128, ScaleKind::kFloat32);
    const double s = static_cast<double>(amax / 448.0f);
    EXPECT_EQ(d[37], -448.0 * s) << amax;
    EXPECT_NEAR(d[37], -static_cast<double>(amax), static_cast<double>(amax) * 0x1p-24) << amax;
  }
  std::vector<double> d = {896.0, 1.0, -3.0};  // 896 / 448 = 2 exactly
  fake_quantize_e4m3(d.data(), 1, 3, 1, 128, ScaleKind::kFloat32);
  EXPECT_EQ(d[0], 896.0);
}

TEST(FakeQuantize, ScaledTiesRoundToEven) {
  // amax 896 gives the exact scale 2, so every element is a hand-made tie
  // between two e4m3 neighbours after scaling.
  std::vector<double> d = {896.0, 2 * 1.0625, 2 * 1.1875, 2 * 3 * 0x1p-10, -2 * 1.0625, 2 * 432.0, 2 * 0x1p-10};
  const std::vector<double> want = {896.0, 2 * 1.0, 2 * 1.25, 2 * 0x1p-8, -2 * 1.0, 896.0, 0.0};
  fake_quantize_e4m3(d.data(), 1, static_cast<int64_t>(d.size()), 1, 128, ScaleKind::kFloat32);
  for (size_t i = 0; i < d.size(); ++i) EXPECT_EQ(d[i], want[i]) << i;
}

TEST(FakeQuantize, OutputsAreE4M3ValuesTimesTheTileScale) {
  Rng rng(6);
  const int64_t rows = 8, cols = 384;
  std::vector<double> d = random_matrix(rng, rows, cols);
  const std::vector<double> in = d;
  fake_quantize_e4m3(d.data(), rows, cols, 1, 128, ScaleKind::kFloat32);
  const std::vector<double>& t = e4m3_magnitudes();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c0 = 0; c0 < cols; c0 += 128) {
      float amax = 0.0f;
      for (int64_t c = c0; c < c0 + 128; ++c) amax = std::max(amax, std::fabs(static_cast<float>(in[r * cols + c])));
      const double s = static_cast<double>(amax / 448.0f);
      for (int64_t c = c0; c < c0 + 128; ++c) {
        const double q = d[r * cols + c] / s;  // exact: q has 4 significant bits, s 24
        ASSERT_TRUE(std::binary_search(t.begin(), t.end(), std::fabs(q))) << "row " << r << " col " << c << ": " << q;
        ASSERT_EQ(std::signbit(q), std::signbit(in[r * cols + c]));
      }
    }
}

TEST(FakeQuantize, ZeroTileStaysZero) {
  for (ScaleKind kind : {ScaleKind::kFloat32, ScaleKind::kPowerOfTwo, ScaleKind::kE8M0}) {
    std::vector<double> d(2 * 256, 0.0);
    d[300] = 5.0;  // second row, first tile: only that tile is non-zero
    fake_quantize_e4m3(d.data(), 2, 256, 1, 128, kind);
    for (size_t i = 0; i < d.size(); ++i) {
      if (i == 300) continue;
      ASSERT_EQ(d[i], 0.0) << i;
      ASSERT_FALSE(std::isnan(d[i]));
    }
    EXPECT_NEAR(d[300], 5.0, 5.0 / 16);
  }
}

TEST(FakeQuantize, TilesAreIndependent) {
  Rng rng(7);
  const int64_t rows = 2, cols = 384;
  const std::vector<double> base = random_matrix(rng, rows, cols);
  std::vector<double> a = base, b = base;
  b[1 * cols + 130] = 1e6;  // row 1, second tile: a new amax there only
  fake_quantize_e4m3(a.data(), rows, cols, 1, 128, ScaleKind::kFloat32);
  fake_quantize_e4m3(b.data(), rows, cols, 1, 128, ScaleKind::kFloat32);
  int changed = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const bool in_tile = r == 1 && c >= 128 && c < 256;
      if (!in_tile) {
        ASSERT_EQ(a[r * cols + c], b[r * cols + c]) << r << "," << c;
      } else if (c != 130 && a[r * cols + c] != b[r * cols + c]) {
        ++changed;
      }
    }
  EXPECT_GT(changed, 64) << "the bigger scale should move most elements of its tile";
}

TEST(FakeQuantize, BlockTilesShareOneScaleAcrossRows) {
  // Row 0 holds 448 (scale 1 for a 128x128 tile); row 1 holds 2^-12, below half
  // the smallest e4m3 subnormal (2^-10) under that scale, so it flushes to
  // zero; with 1x128 tiles row 1 has its own scale and survives.
  const int64_t rows = 2, cols = 128;
  std::vector<double> in(rows * cols);
  for (int64_t c = 0; c < cols; ++c) {
    in[c] = 448.0;
    in[cols + c] = std::ldexp(1.0, -12);
  }
  std::vector<double> block = in, row = in;
  fake_quantize_e4m3(block.data(), rows, cols, 128, 128, ScaleKind::kFloat32);
  fake_quantize_e4m3(row.data(), rows, cols, 1, 128, ScaleKind::kFloat32);
  for (int64_t c = 0; c < cols; ++c) {
    EXPECT_EQ(block[c], 448.0);
    EXPECT_EQ(row[c], 448.0);
    EXPECT_EQ(block[cols + c], 0.0);
    EXPECT_NEAR(row[cols + c], std::ldexp(1.0, -12), std::ldexp(1.0, -12 - 20));
  }
}

TEST(FakeQuantize, ColumnTilesQuantiseAlongColumns) {
  // Column 0 is large, column 1 tiny: with g x 1 tiles each column keeps its own
  // scale, with 1 x g tiles the tiny column is flushed by row 0's scale.
  const int64_t rows = 4, cols = 2;
  std::vector<double> in = {1000.0, 1e-4, 900.0, 2e-4, 800.0, 3e-4, 700.0, 4e-4};
  std::vector<double> by_col = in, by_row = in;
  fake_quantize_e4m3(by_col.data(), rows, cols, 128, 1, ScaleKind::kFloat32);
  fake_quantize_e4m3(by_row.data(), rows, cols, 1, 128, ScaleKind::kFloat32);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_NEAR(by_col[r * cols + 1], in[r * cols + 1], in[r * cols + 1] / 16) << r;
    EXPECT_EQ(by_row[r * cols + 1], 0.0) << r;
  }
  // The largest of column 0 maps to 448 * (1000 / 448).
  EXPECT_EQ(by_col[0], 448.0 * static_cast<double>(1000.0f / 448.0f));
  EXPECT_EQ(by_col[3 * cols + 1], 448.0 * static_cast<double>(static_cast<float>(4e-4) / 448.0f));
}

TEST(FakeQuantize, RelativeErrorIsWithinHalfAnE4M3Ulp) {
  // Three mantissa bits: the worst relative rounding error of a normal value is
  // (2^-4) / (1 + 2^-4) = 1/17, at 1 + 1/16. Below 2^-6 (subnormal) the error is
  // at most half the spacing, 2^-10, in scaled units.
  Rng rng(8);
  const int64_t rows = 64, cols = 512;
  std::vector<double> in(rows * cols);
  for (double& v : in) v = static_cast<double>(log_uniform(rng, -14, 6));
  std::vector<double> d = in;
  fake_quantize_e4m3(d.data(), rows, cols, 1, 128, ScaleKind::kFloat32);
  double worst = 0.0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c0 = 0; c0 < cols; c0 += 128) {
      float amax = 0.0f;
      for (int64_t c = c0; c < c0 + 128; ++c) amax = std::max(amax, std::fabs(static_cast<float>(in[r * cols + c])));
      const double s = static_cast<double>(amax) / 448.0;
      for (int64_t c = c0; c < c0 + 128; ++c) {
        const double v = in[r * cols + c], err = std::fabs(d[r * cols + c] - v);
        if (std::fabs(v) / s >= 0x1p-6) {
          ASSERT_LE(err, std::fabs(v) * (1.0 / 17 + 1e-6)) << v;
          worst = std::max(worst, err / std::fabs(v));
        } else {
          ASSERT_LE(err, s * (0x1p-10 + 1e-6)) << v;
        }
      }
    }
  EXPECT_GT(worst, 0.05) << "random data should come close to the 1/17 bound";
}

TEST(FakeQuantize, NaNPoisonsOnlyItsTile) {
  std::vector<double> d(256, 7.0);  // 7 / 448 = 2^-6: the second tile is exact
  d[10] = std::nan("");
  fake_quantize_e4m3(d.data(), 1, 256, 1, 128, ScaleKind::kFloat32);
  for (int i = 0; i < 128; ++i) EXPECT_TRUE(std::isnan(d[i])) << i;
  for (int i = 128; i < 256; ++i) EXPECT_EQ(d[i], 7.0) << i;
}

// Known bug: a tile whose amax is a float subnormal below 448 * 2^-150 gets a
// kFloat32 / kPowerOfTwo scale that underflows to 0, so 0 / s turns the tile's
// zeros into NaN (and every other element into 448 * 0 = 0). Enable once the
// scale is kept representable.
TEST(FakeQuantize, TinySubnormalTileStaysFinite) {
  for (ScaleKind kind : {ScaleKind::kFloat32, ScaleKind::kPowerOfTwo, ScaleKind::kE8M0}) {
    std::vector<double> d = {1e-44, 0.0};
    fake_quantize_e4m3(d.data(), 1, 2, 1, 128, kind);
    EXPECT_FALSE(std::isnan(d[0])) << static_cast<int>(kind);
    EXPECT_EQ(d[1], 0.0) << static_cast<int>(kind);
  }
}

// The GPU quantizers' division-free quotient (cuda/fp8/e4m3.cuh,
// E4m3Quotients) with fp32 scales, emulated with the same IEEE fp32
// operations: r = fl(1 / s), y = fl(v r), e = fl(y s - v), q = fl(y - e r).
float corrected_quotient(float v, float s) {
  const float r = 1.0f / s, y = v * r;
  const float e = std::fmaf(y, s, -v);
  return std::fmaf(-e, r, y);
}

// Every bf16 value v with |v| <= amax against the fp32 scales of every 31st
// bf16 amax from 2^-96 (where the quantizers take the quotient; below it
// they divide) to the largest: e4m3(q) == e4m3(fl(v / s)), always. The whole
// domain (1.07e9 pairs) was checked once in session 25: no difference from
// 2^-96 up; 206, all at amax <= 2^-105, below (the residual e underflows).
// The controls show the sample can fail: q itself differs from fl(v / s),
// and y alone (no correction) has e4m3 codes that differ.
TEST(E4M3Quotient, CorrectedQuotientHasTheDivisionsCodes) {
  int64_t checked = 0, wrong = 0, quotient_bits_differ = 0, uncorrected_wrong = 0;
  const uint32_t first = bf16_bits_from_float(0x1p-96f);
  for (uint32_t amax_bits = first; amax_bits < 0x7F80; amax_bits += 31) {
    const float amax = float_from_bf16_bits(static_cast<uint16_t>(amax_bits));
    ASSERT_GE(amax, 0x1p-96f);
    const float s = megamoe::fp8_scale_fp32(amax);
    for (uint32_t vb = 0; vb < 0x10000; ++vb) {
      const float v = float_from_bf16_bits(static_cast<uint16_t>(vb));
      if (!(std::fabs(v) <= amax)) continue;  // a tile's values: |v| <= amax
      const float want = v / s, q = corrected_quotient(v, s);
      wrong += e4m3_from_float(q) != e4m3_from_float(want);
      quotient_bits_differ += bits_of(q) != bits_of(want);
      uncorrected_wrong += e4m3_from_float(v * (1.0f / s)) != e4m3_from_float(want);
      ++checked;
    }
  }
  EXPECT_GT(checked, 20000000);
  EXPECT_EQ(wrong, 0) << "of " << checked;
  EXPECT_GT(quotient_bits_differ, 0) << "q is fl(v / s) everywhere: the e4m3 comparison tests nothing";
  EXPECT_GT(uncorrected_wrong, 0) << "v * (1 / s) alone has the division's codes: the sample has no hard case";
}

// The device's fp32 scale without a division (cuda/fp8/e4m3.cuh,
// scale_fp32_of_bf16_amax): bitwise fp8_scale_fp32 for every finite bf16
// amax; y alone (no correction) is not, so the check can fail.
TEST(E4M3Quotient, ScaleWithoutTheDivisionIsTheScaleForEveryBf16Amax) {
  const float r = 1.0f / 448.0f;
  int differ = 0, uncorrected_differ = 0;
  for (uint32_t b = 0; b < 0x7F80; ++b) {
    const float amax = float_from_bf16_bits(static_cast<uint16_t>(b));
    float s = 1.0f, y = 1.0f;
    if (amax != 0.0f) {
      y = amax * r;
      const float e = std::fmaf(y, 448.0f, -amax);
      s = std::fmaf(-e, r, y);
      s = s < FLT_MIN ? FLT_MIN : s;
      y = y < FLT_MIN ? FLT_MIN : y;
    }
    differ += bits_of(s) != bits_of(megamoe::fp8_scale_fp32(amax));
    uncorrected_differ += bits_of(y) != bits_of(megamoe::fp8_scale_fp32(amax));
  }
  EXPECT_EQ(differ, 0);
  EXPECT_GT(uncorrected_differ, 0);
}

// Signed zeros keep their sign (e4m3 0x80 for -0), as the division's do.
TEST(E4M3Quotient, CorrectedQuotientKeepsTheSignOfZero) {
  for (const float s : {1.0f, 0x1p-90f, 3.5f, 1e30f}) {
    EXPECT_EQ(bits_of(corrected_quotient(-0.0f, s)), bits_of(-0.0f)) << s;
    EXPECT_EQ(bits_of(corrected_quotient(0.0f, s)), bits_of(0.0f)) << s;
  }
}

}  // namespace
}  // namespace megamoe::numerics
