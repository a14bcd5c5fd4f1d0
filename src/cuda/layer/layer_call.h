// One call of the CUDA layer, whatever runs it (the one-GPU layer or an
// expert-parallel owner): its dims, device, stream, error sink and paths, its
// device pointers. The layer owns no memory: the caller passes a scratch
// buffer (shared by all layers on a device and stream) and, for a backward, a
// saved buffer (per call, through the caller's allocator). Layouts:
// core/layer_buffers.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/layer_buffers.h"
#include "cuda/common/device_errors.h"
#include "cuda/fp8/quantize.h"
#include "megamoe/moe.h"
#include "megamoe/status.h"

namespace megamoe::cuda {

// Device pointers of one call (bf16 unless noted).
struct LayerInputs {
  const void* x;
  const int32_t* topk_idx;
  const float* topk_weights;
  const void* w13;
  const void* w2;
};

struct LayerGrads {
  void* dx;
  float* d_topk_weights;
  void* dw13;
  void* dw2;
  bool wgrad_f32;   // dw13/dw2 are fp32 (else bf16)
  bool accumulate;  // fp32 only: add to dw13/dw2
};

// Buffers are megamoe::MoeBuffers: scratch of scratch_layout(dims, saved == nullptr).bytes,
// saved of saved_layout(dims).bytes or null.
using LayerBuffers = MoeBuffers;

struct LayerCall {
  LayerDims dims;
  int device = 0;
  DeviceErrorSink errors;
  cudaStream_t stream = nullptr;
  // An expert-parallel owner's call: its slot rows go to the source ranks'
  // return areas, so its scratch has no slots region (bytes_without_slots).
  bool slots_at_sources = false;
  CudaPaths paths;  // which of two equivalent paths the steps take (megamoe/problem.h)
};

// Checks the device (Hopper), top_k and buffer sizes; fills call->errors
// (keeping the bound the caller set in call->errors.timeout_ns) and the rest.
Status prepare_layer_call(const LayerDims& dims, int device, cudaStream_t stream, const LayerBuffers& buffers,
                          LayerCall* call, bool slots_at_sources = false);

// The kernels are sm_90a: a clear error for any other device (asked once per device).
Status check_hopper(int device);
int sm_count(int device);

bool fp8_forward(const LayerDims& d);   // fp8: the forward's GEMMs in FP8
bool fp8_backward(const LayerDims& d);  // fp8, fp8_bwd: the backward's
Fp8Scale fp8_scale_of(const LayerDims& d);

}  // namespace megamoe::cuda
