// Low-precision number formats as the GPU rounds them, for the CPU reference.
//
//   bf16      1-8-7, round-to-nearest-even, NaN kept (quiet), overflow -> inf.
//   e4m3      OCP FP8 "E4M3FN": bias 7, no infinities, max finite +-448, NaN =
//             S.1111.111, subnormals m * 2^-9. Encoding rounds to nearest even
//             and saturates every finite (and infinite) value beyond 448 to
//             +-448, like cvt.rn.satfinite.e4m3x2.f32; NaN -> 0x7F.
//   e8m0      MX scale: 2^(c - 127) for c in [0, 254], c = 255 is NaN.
//
// Block scaling (one scale per tile of the operand):
//   kFloat32    s = amax / 448 (fp32), q = e4m3(v / s)
//   kPowerOfTwo s = 2^ceil(log2(amax / 448)), so |v / s| <= 448 exactly
//   kE8M0       s = 2^ceil(log2(amax / 448)) stored as E8M0 (exponent clamped
//               to [-127, 127]). The OCP MX spec's 2^(floor(log2 amax) - 8)
//               saturates elements in (448, 512) * s; measured on the layer
//               tests it gave 0.11 relative error against 0.066 for this choice.
// An all-zero tile gets s = 1 (kFloat32, kPowerOfTwo) or 2^-127 (kE8M0); the
// fp8 scales are never below FLT_MIN (no zero scale for subnormal tiles). A
// NaN amax gives a NaN scale; an infinite one gives an infinite scale
// (kFloat32, kPowerOfTwo: the tile's finite values become 0, its infinities
// NaN) or 2^127 (kE8M0).
#pragma once

#include <cstdint>

#include "megamoe/types.h"

namespace megamoe::numerics {

uint16_t bf16_bits_from_float(float v);
float float_from_bf16_bits(uint16_t bits);
inline float round_to_bf16(float v) { return float_from_bf16_bits(bf16_bits_from_float(v)); }

inline constexpr float kE4M3Max = 448.0f;
uint8_t e4m3_from_float(float v);
float float_from_e4m3(uint8_t code);
inline float round_to_e4m3(float v) { return float_from_e4m3(e4m3_from_float(v)); }

// exponent in [-127, 127] -> code; decode gives 2^(code - 127), NaN for 255.
uint8_t e8m0_from_exponent(int exponent);
float float_from_e8m0(uint8_t code);

enum class ScaleKind { kFloat32, kPowerOfTwo, kE8M0 };
ScaleKind scale_kind(ScaleMode mode);  // the FP8 (not MX) recipes
float block_scale(float amax, ScaleKind kind);

// Quantizes `data` ([rows, cols], row-major) to e4m3 with one scale per
// tile_rows x tile_cols tile (edge tiles may be partial) and writes back the
// dequantized values: the exact operand values a block-scaled GEMM sees.
void fake_quantize_e4m3(double* data, int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols,
                        ScaleKind kind);

}  // namespace megamoe::numerics
