// The layer's FP8 weights (MoeBuffers::fp8_weights, Fp8WeightLayout): the
// caller's buffer, checked, and quantised from w13 and w2 unless the caller
// says it is current (fp8_weights_ready). Host code; async on the call's
// stream.
#pragma once

#include "cuda/layer/call_buffers.h"
#include "cuda/layer/layer_call.h"

namespace megamoe::cuda {

// The FP8 weight buffer: there, aligned and large enough.
Status check_fp8_weights(const LayerDims& dims, const LayerBuffers& buffers);

// A call that reads the buffer needs it (`reads`: fp8's forward, every FP8
// backward); fp8_bwd's forward reads none, but fills a buffer it is given
// for its backward.
Status refresh_fp8_weights(const LayerCall& call, const LayerBuffers& buffers, const Fp8WeightRegions& w,
                           const LayerInputs& in, bool reads);

// w13 and w2 into the weight regions: 128 x 128 blocks, as given (fp8 only)
// and transposed, one scale per block.
Status fill_fp8_weights(const LayerCall& call, const Fp8WeightRegions& w, const void* w13, const void* w2);

// The same for a caller that refreshes the buffer apart from the layer calls
// (moe_fill_fp8_weights): checks the device and the buffer's size.
Status fill_layer_fp8_weights(const LayerDims& dims, int device, cudaStream_t stream, const void* w13,
                              const void* w2, const LayerBuffers& buffers);

}  // namespace megamoe::cuda
