// The MoE layer on one GPU (EP size 1), BF16: device routing plan -> gather
// into the expert-major pool -> GEMM1 + SwiGLU -> GEMM2 + routing weight into
// combine slots -> fixed-order slot sum; the backward in reverse plus the
// K-grouped weight gradients. No host synchronisation, no per-expert host
// loop, no float atomics: the whole forward + backward is graph-capturable.
//
// The layer owns no memory: the caller passes a scratch buffer (shared by all
// layers on a device and stream) and, for a backward, a saved buffer (per
// call, through the caller's allocator). Layouts: core/layer_buffers.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/layer_buffers.h"
#include "cuda/common/device_errors.h"
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
};

// Checks the device (Hopper), top_k and buffer sizes; fills call->errors.
Status prepare_layer_call(const LayerDims& dims, int device, cudaStream_t stream, const LayerBuffers& buffers,
                          LayerCall* call, bool slots_at_sources = false);

// buffers.fp8_weights (precision fp8 / fp8_bwd) filled from w13 and w2, as a
// call not marked fp8_weights_ready does before its GEMMs. Checks the device
// and the buffer's size; async on `stream`.
Status fill_layer_fp8_weights(const LayerDims& dims, int device, cudaStream_t stream, const void* w13,
                              const void* w2, const LayerBuffers& buffers);

// With buffers.saved, the plan and z are written there for the backward;
// without, the plan lives in scratch and z is not kept.
Status layer_forward(const LayerCall& call, const LayerInputs& in, void* y, const LayerBuffers& buffers);
// With buffers.saved (from this forward), plan and z are read from it; without,
// both are recomputed into scratch first.
Status layer_backward(const LayerCall& call, const LayerInputs& in, const void* dy, const LayerGrads& grads,
                      const LayerBuffers& buffers);

}  // namespace megamoe::cuda
