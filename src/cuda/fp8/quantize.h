// Block-scaled FP8 (e4m3) quantizers of the DeepSeek-V3 style recipe
// (reference/numerics.h states it; core/fp8_scale.h is the scale rule, shared
// with the CPU reference, which these match bit for bit):
//   q = e4m3_satfinite(v / s) (IEEE fp32 division, cvt.rn.satfinite), one
//   scale s per tile. The kernels reach the same codes without a division
//   per value where that is proven (fp8::E4m3Quotients: with pow2 scales a
//   multiply; with fp32 scales a multiply and two fma, and the division for
//   tiles of amax in (0, 2^-96) or non-finite).
//
// Layouts (row-major, bytes):
//   rows:   x bf16 [rows, cols] -> q u8 [rows, cols], scales f32 [rows, cols / 128]
//           (1 x 128 tiles along the row: activations and output gradients,
//           K along the row); or, RowScales::kByKBlock, scales [cols / 128,
//           rows]: a k-block's scales of consecutive rows are contiguous, so
//           the grouped GEMM brings a tile's 128 through its stages
//           (GroupedGemmArgs::a_scales_by_k_block). Their row stride is the
//           `rows` (or `capacity`) passed here, which must be the GEMM's
//           a_rows: quantise every row of the pool, not only the used ones.
//   blocks: w bf16 [batch, rows, cols] -> q u8 [batch, rows, cols] and/or
//           q_t u8 [batch, cols, rows] (the same bytes transposed: the other
//           orientation a backward GEMM reads K-major), scales f32
//           [batch, rows / 128, cols / 128] (128 x 128 tiles: weights; a tile's
//           scale serves both orientations).
//   cols_t: x bf16 [rows, cols] -> q_t u8 [cols, rows] (transposed: K = rows
//           along q_t's rows), scales f32 [rows / 128, cols] (128 x 1 tiles:
//           the weight-gradient operands, K = tokens, scaled per 128 tokens of
//           each channel).
// rows and cols must be multiples of 128 (the layer's shapes are). Async on
// `stream`; no host synchronisation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "megamoe/status.h"

namespace megamoe::cuda {

enum class Fp8Scale { kFloat32, kPowerOfTwo };
// Where the row quantizers put a row's scales (the values are the same).
enum class RowScales { kByRow, kByKBlock };

// used_rows (optional, device memory): only rows [0, *used_rows) are
// quantised (a pool's used rows; rows stays the scales' row stride).
Status quantize_e4m3_rows(const void* x, int64_t rows, int64_t cols, Fp8Scale scale, uint8_t* q, float* scales,
                          cudaStream_t stream, RowScales layout = RowScales::kByRow,
                          const int32_t* used_rows = nullptr);

// The row quantizer fused with the pool gather (cuda/layer/layer_kernels.h
// gather_rows): pool row r < *pool_rows is src row row_src[r] / top_k, zeros
// where row_src[r] < 0; q [capacity, cols], scales [capacity, cols / 128] for
// those rows, bitwise what quantize_e4m3_rows makes of the gathered pool;
// rows from *pool_rows on are not written (kByKBlock: scales [cols / 128,
// capacity]). pool (may be null): the bf16 rows as gather_rows writes them,
// when a later step still needs them.
Status gather_quantize_e4m3_rows(const void* src, int64_t cols, const int32_t* row_src, int top_k,
                                 const int32_t* pool_rows, int64_t capacity, Fp8Scale scale, uint8_t* q,
                                 float* scales, void* pool, cudaStream_t stream,
                                 RowScales layout = RowScales::kByRow);

// gather_quantize_e4m3_rows' output made the other way round: each token row
// of src [tokens, cols] is read and quantised once and written to the pool
// row route_row[t * top_k + j] of each of its routes that has one (>= 0,
// below *pool_rows); the pool's padding rows (row_src < 0, below *pool_rows)
// get an all-zero tile's codes and scales (and zeros in pool). With the
// device plan's route_row and row_src, inverse maps (row_src[route_row[i]]
// == i for every route i with a row, and route_row[row_src[r]] == r for
// every used row r with a route: cuda/layer/device_plan.cu writes both
// together), bitwise what gather_quantize_e4m3_rows writes, reading each
// token row once instead of top_k times; a used row with a route that does
// not point back to it would keep its old bytes. Two launches.
Status scatter_quantize_e4m3_rows(const void* src, int64_t tokens, int64_t cols, const int32_t* route_row, int top_k,
                                  const int32_t* row_src, const int32_t* pool_rows, int64_t capacity, Fp8Scale scale,
                                  uint8_t* q, float* scales, void* pool, cudaStream_t stream,
                                  RowScales layout = RowScales::kByRow);

// A row of cols values as an e4m3 slot (expert parallelism's dispatch,
// cuda/comm/dispatch.h): its cols e4m3 bytes, then its cols / 128 f32 scales;
// bytes rounded up to 16 (the slots move as 16-byte pieces).
constexpr int64_t e4m3_slot_bytes(int64_t cols) { return (cols + cols / 128 * 4 + 15) / 16 * 16; }

// The row quantizer into slots of slot_bytes (>= e4m3_slot_bytes(cols), a
// multiple of 16): row r's bytes at slots + r * slot_bytes, its scales right
// after them; the same values as quantize_e4m3_rows. rows may be 0.
Status quantize_e4m3_rows_to_slots(const void* x, int64_t rows, int64_t cols, Fp8Scale scale, void* slots,
                                   int64_t slot_bytes, cudaStream_t stream);

Status quantize_e4m3_blocks(const void* w, int64_t batch, int64_t rows, int64_t cols, Fp8Scale scale, uint8_t* q,
                            uint8_t* q_t, float* scales, cudaStream_t stream);

// used_rows (optional, device memory; a pool's used rows, a multiple of 128):
// the 128-row blocks from *used_rows on are not written (a block that
// *used_rows ends inside is quantised whole).
Status quantize_e4m3_cols_t(const void* x, int64_t rows, int64_t cols, Fp8Scale scale, uint8_t* q_t, float* scales,
                            cudaStream_t stream, const int32_t* used_rows = nullptr);

// The column quantizer fused with the pool gather: q_t [cols, capacity] and
// scales [capacity / 128, cols] of the pool gather_rows would make (row r <
// *pool_rows: src row row_src[r] / top_k, zeros where row_src[r] < 0),
// bitwise what quantize_e4m3_cols_t makes of it, without writing the bf16
// pool; the 128-row blocks from *pool_rows on (a multiple of 128: the pool's
// experts are padded to whole blocks) are not written. capacity and cols
// multiples of 128.
Status gather_quantize_e4m3_cols_t(const void* src, int64_t cols, const int32_t* row_src, int top_k,
                                   const int32_t* pool_rows, int64_t capacity, Fp8Scale scale, uint8_t* q_t,
                                   float* scales, cudaStream_t stream);

}  // namespace megamoe::cuda
