// The memory-bound steps of the layer around the GEMMs: token rows into the
// expert-major pool (the P = 1 dispatch: the layer scatters, scatter_rows;
// gather_rows makes the same pool row by row, the reference of the tests and
// gemm-bench), the fixed-order slot sums (combine), and the reduction of
// d topk_w partials.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_errors.h"
#include "megamoe/status.h"

namespace megamoe::cuda {

// pool[r] = src[row_src[r] / k] for r < *pool_rows, zeros for padding rows.
// src [T, width] bf16, pool [capacity, width] bf16.
Status gather_rows(const void* src, int64_t width, const int32_t* row_src, int top_k, const int32_t* pool_rows,
                   int64_t capacity, void* pool, cudaStream_t stream);

// The same pool as gather_rows, made by reading each token row once: pool
// row route_row[t k + j] = src[t] for each route with a row (>= 0), zeros
// in the padding rows (row_src < 0, below *pool_rows). route_row and row_src
// must be the device plan's inverse maps (route_row[row_src[r]] == r for
// every used row r with a source); rows from *pool_rows on are not written.
// One launch; src [tokens, width] bf16, width a multiple of 8.
Status scatter_rows(const void* src, int64_t tokens, int64_t width, const int32_t* route_row, int top_k,
                    const int32_t* row_src, const int32_t* pool_rows, int64_t capacity, void* pool,
                    cudaStream_t stream);

// out[t] = bf16(sum_{j = 0..k-1, 0 <= topk_idx[t,j] < E} slots[j, t]) in fp32, j in order.
// slots: bf16 [top_k][slot_tokens][width], slot_tokens >= num_tokens (0: num_tokens).
// If the plan found a routing error, out is filled with NaN (never silently wrong)
// and the error is reported to `errors` (the host raises it at its next look).
Status combine_slots(const void* slots, const int32_t* topk_idx, int64_t num_tokens, int top_k, int num_experts,
                     int64_t width, const unsigned long long* error_key, const DeviceErrorSink& errors, void* out,
                     cudaStream_t stream, int64_t slot_tokens = 0);

// combine_slots over rows in pool order (GroupedGemmArgs::down_to_pool): route
// j of token t is row route_row[t k + j] of rows [capacity][width] bf16 (the
// plan's), summed in j order with the same arithmetic (bit for bit the slot
// sums when the rows are the slots' rows).
Status combine_pool_rows(const void* rows, const int32_t* route_row, const int32_t* topk_idx, int64_t num_tokens,
                         int top_k, int num_experts, int64_t width, const unsigned long long* error_key,
                         const DeviceErrorSink& errors, void* out, cudaStream_t stream);

// d_topk_w[t, j] = sum_n partial[route_row[t, j], n] (n in order), 0 for no route; NaN on a routing error.
Status reduce_route_partials(const float* partial, int n_parts, const int32_t* route_row, int64_t num_routes,
                             const unsigned long long* error_key, float* out, cudaStream_t stream);

}  // namespace megamoe::cuda
