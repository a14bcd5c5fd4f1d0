// The MoE layer on one GPU (EP size 1): device routing plan -> x's rows into
// the expert-major pool -> GEMM1 + SwiGLU -> GEMM2 x routing weight into
// combine slots (or pool-order rows) -> fixed-order sum; the backward in
// reverse plus the K-grouped weight gradients (the steps: layer_steps.h). No
// host synchronisation, no per-expert host loop, no float atomics: the whole
// forward + backward is graph-capturable.
#pragma once

#include "cuda/layer/layer_call.h"

namespace megamoe::cuda {

// With buffers.saved, the plan and z are written there for the backward;
// without, the plan lives in scratch and z is not kept.
Status layer_forward(const LayerCall& call, const LayerInputs& in, void* y, const LayerBuffers& buffers);
// With buffers.saved (from this forward), plan and z are read from it; without,
// both are recomputed into scratch first.
Status layer_backward(const LayerCall& call, const LayerInputs& in, const void* dy, const LayerGrads& grads,
                      const LayerBuffers& buffers);

}  // namespace megamoe::cuda
