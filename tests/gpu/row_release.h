// A stand-in for expert-parallel dispatch in the engine tests: a kernel that
// delivers a pool's row tiles late and out of order while a grouped GEMM
// that waits for them (GroupedGemmArgs::rows_ready) runs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megamoe::testing {

// One block. For each i < tiles, tile m = order[i] (device array): wait about
// delay_ns, copy pool rows [128 m, 128 m + 128) x cols bf16 from src to dst,
// then release-store ready_value into counters[m] (GPU scope). cols * 2 must
// be a multiple of 16.
cudaError_t launch_row_release(const void* src, void* dst, int64_t cols, const int32_t* order, int tiles,
                               uint32_t* counters, uint32_t ready_value, uint64_t delay_ns, cudaStream_t stream);

}  // namespace megamoe::testing
