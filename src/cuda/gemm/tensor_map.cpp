#include "cuda/gemm/tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <mutex>
#include <string>

namespace megamoe::cuda {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  return fn;
}

// Row-major [rows, cols] of elem_bytes-byte elements, boxes of 64 rows x one
// 128-byte swizzle row.
Status make_tma_2d_box64(const void* base, int64_t rows, int64_t cols, int elem_bytes, CUtensorMapDataType type,
                         const char* type_name, CUtensorMap* map) {
  auto fn = encode_fn();
  if (fn == nullptr) return unavailable("cuTensorMapEncodeTiled not found in the CUDA driver");
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || (cols * elem_bytes) % 16 != 0)
    return internal_error("TMA: base and row pitch must be 16-byte aligned");
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * elem_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / elem_bytes), 64};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = fn(map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return internal_error("cuTensorMapEncodeTiled failed (" + std::to_string(static_cast<int>(r)) + ") for a [" +
                          std::to_string(rows) + ", " + std::to_string(cols) + "] " + type_name + " matrix");
  return Status::Ok();
}

}  // namespace

Status make_tma_2d_bf16_box64(const void* base, int64_t rows, int64_t cols, CUtensorMap* map) {
  return make_tma_2d_box64(base, rows, cols, 2, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, "bf16", map);
}

Status make_tma_2d_e4m3_box64x128(const void* base, int64_t rows, int64_t cols, CUtensorMap* map) {
  return make_tma_2d_box64(base, rows, cols, 1, CU_TENSOR_MAP_DATA_TYPE_UINT8, "e4m3", map);
}

}  // namespace megamoe::cuda
