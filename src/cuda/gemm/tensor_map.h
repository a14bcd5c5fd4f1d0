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

// A [rows, cols] e4m3 (one byte per element) matrix read in boxes of 64 rows x
// 128 elements: the same 128-byte box rows and swizzle as the bf16 boxes.
Status make_tma_2d_e4m3_box64x128(const void* base, int64_t rows, int64_t cols, CUtensorMap* map);

}  // namespace megamoe::cuda
