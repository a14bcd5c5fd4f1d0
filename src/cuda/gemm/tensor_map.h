// TMA descriptors (CUtensorMap) for row-major bf16 matrices, encoded through
// the driver entry point so that nothing links libcuda directly.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "megamoe/status.h"

namespace megamoe::cuda {

// A [rows, cols] bf16 matrix read in 64 x 64 boxes (128 bytes per box row,
// 128-byte swizzle, out-of-bounds elements read as zero).
Status make_tma_2d_bf16_box64(const void* base, int64_t rows, int64_t cols, CUtensorMap* map);

// The same matrix read one row at a time (boxes of 1 row x 64 elements, the
// same swizzle): a load into a 1024-byte-aligned box's row r lands as row r of
// a 64 x 64 box load does, because the 128-byte swizzle is a function of the
// shared-memory address (the row gathers of the grouped GEMM rely on it).
Status make_tma_2d_bf16_row64(const void* base, int64_t rows, int64_t cols, CUtensorMap* map);

// A [rows, cols] e4m3 (one byte per element) matrix read in boxes of 64 rows x
// 128 elements: the same 128-byte box rows and swizzle as the bf16 boxes.
Status make_tma_2d_e4m3_box64x128(const void* base, int64_t rows, int64_t cols, CUtensorMap* map);

}  // namespace megamoe::cuda
