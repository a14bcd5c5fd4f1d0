// The slot combine's arithmetic, shared by combine_slots_kernel
// (layer_kernels.cu) and the grouped GEMM's side job (gemm/side_jobs.cuh),
// so that both give the same bits: a token's 16-byte chunk (8 bf16) is the
// fp32 sum, in route order j = 0, 1, ..., of its valid routes' slot chunks,
// rounded to bf16 once; every chunk NaN when the routing plan failed.
// Device code only.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/device_errors.h"
#include "cuda/plan/device_plan.h"

namespace megamoe::cuda {

// acc += the 8 bf16 of one slot chunk, in fp32.
__device__ __forceinline__ void add_slot_chunk(float (&acc)[8], const uint4& v) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(p[q]);
    acc[2 * q] += f.x;
    acc[2 * q + 1] += f.y;
  }
}

// The token's chunk: acc rounded to bf16, or NaN when the plan failed.
__device__ __forceinline__ uint4 finish_slot_chunk(const float (&acc)[8], bool failed) {
  uint4 o;
  __nv_bfloat162* po = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int q = 0; q < 4; ++q)
    po[q] = failed ? __floats2bfloat162_rn(NAN, NAN) : __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
  return o;
}

// A failed plan's report (error_key: route << 2 | kPlanError*), named by the
// bad route's expert id. A peer's failure (kPlanErrorPeer) names route 0,
// which may not exist; its own timeout report came first and stands.
__device__ __forceinline__ void report_failed_plan(const DeviceErrorSink& errors, unsigned long long key,
                                                   const int32_t* topk_idx, int64_t num_tokens, int k, int E) {
  const unsigned long long route = key >> 2;
  const int32_t id = route < static_cast<unsigned long long>(num_tokens * k) ? topk_idx[route] : -1;
  report_routing(errors, key, id, static_cast<uint32_t>(k), static_cast<uint32_t>(E));
}

}  // namespace megamoe::cuda
