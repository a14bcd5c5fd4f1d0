#include "cuda/layer/fp8_weights.h"

#include <string>

#include "cuda/fp8/quantize.h"

namespace megamoe::cuda {

Status check_fp8_weights(const LayerDims& dims, const LayerBuffers& buffers) {
  Fp8WeightLayout wl;
  MEGAMOE_RETURN_IF_ERROR(fp8_weight_layout(dims, &wl));
  if (wl.bytes > 0 && (buffers.fp8_weights == nullptr || buffers.fp8_weights_bytes < wl.bytes))
    return invalid_argument("fp8_weights: precision " + std::string(to_string(dims.precision)) +
                            " needs the layer's FP8 weight buffer of " + std::to_string(wl.bytes) + " bytes, " +
                            (buffers.fp8_weights == nullptr ? std::string("none")
                                                            : std::to_string(buffers.fp8_weights_bytes) + " bytes") +
                            " given (moe_buffer_sizes)");
  if (reinterpret_cast<uintptr_t>(buffers.fp8_weights) % kBufferAlign != 0)
    return invalid_argument("fp8_weights: the buffer must be 256-byte aligned");
  return Status::Ok();
}

Status refresh_fp8_weights(const LayerCall& call, const LayerBuffers& buffers, const Fp8WeightRegions& w,
                           const LayerInputs& in, bool reads) {
  if (!fp8_backward(call.dims) || (!reads && buffers.fp8_weights == nullptr)) return Status::Ok();
  MEGAMOE_RETURN_IF_ERROR(check_fp8_weights(call.dims, buffers));
  if (buffers.fp8_weights_ready) return Status::Ok();
  return fill_fp8_weights(call, w, in.w13, in.w2);
}

Status fill_fp8_weights(const LayerCall& call, const Fp8WeightRegions& w, const void* w13, const void* w2) {
  const LayerDims& d = call.dims;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts;
  const Fp8Scale sc = fp8_scale_of(d);
  MEGAMOE_RETURN_IF_ERROR(quantize_e4m3_blocks(w13, E, 2 * I, H, sc, w.w13_q, w.w13_t, w.w13_s, call.stream));
  return quantize_e4m3_blocks(w2, E, H, I, sc, w.w2_q, w.w2_t, w.w2_s, call.stream);
}

Status fill_layer_fp8_weights(const LayerDims& dims, int device, cudaStream_t stream, const void* w13,
                              const void* w2, const LayerBuffers& buffers) {
  if (!fp8_backward(dims))
    return invalid_argument(std::string("fp8 weights: precision ") + to_string(dims.precision) + " has none");
  MEGAMOE_RETURN_IF_ERROR(check_fp8_weights(dims, buffers));
  MEGAMOE_RETURN_IF_ERROR(check_hopper(device));
  LayerCall call;
  call.dims = dims, call.device = device, call.stream = stream;
  Fp8WeightRegions w{};
  MEGAMOE_RETURN_IF_ERROR(carve_fp8_weights(dims, buffers.fp8_weights, &w));
  return fill_fp8_weights(call, w, w13, w2);
}

}  // namespace megamoe::cuda
