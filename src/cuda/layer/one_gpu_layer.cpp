#include "cuda/layer/one_gpu_layer.h"

#include "cuda/layer/call_buffers.h"
#include "cuda/layer/fp8_weights.h"
#include "cuda/layer/layer_gemms.h"
#include "cuda/layer/layer_kernels.h"
#include "cuda/layer/layer_steps.h"
#include "cuda/plan/device_plan.h"

namespace megamoe::cuda {
namespace {

// The call's buffers carved, its FP8 weights current where the call reads them.
Status begin(const LayerCall& call, const LayerInputs& in, const LayerBuffers& buffers, bool reads_fp8_weights,
             CallBuffers* b) {
  if (call.slots_at_sources) return invalid_argument("one-GPU layer: an expert-parallel owner's call (no slots region)");
  MEGAMOE_RETURN_IF_ERROR(carve_call_buffers(call, buffers, b));
  return refresh_fp8_weights(call, buffers, b->fp8_weights, in, reads_fp8_weights);
}

Status build_plan(const LayerCall& call, const LayerInputs& in, const CallBuffers& b) {
  const LayerDims& d = call.dims;
  return build_device_plan(in.topk_idx, d.tokens, d.top_k, d.num_experts, b.plan, call.stream);
}

}  // namespace

Status layer_forward(const LayerCall& call, const LayerInputs& in, void* y, const LayerBuffers& buffers) {
  CallBuffers b;
  MEGAMOE_RETURN_IF_ERROR(begin(call, in, buffers, fp8_forward(call.dims), &b));
  const LayerDims& d = call.dims;
  const LayerStep s{call, b, sm_count(call.device)};
  MEGAMOE_RETURN_IF_ERROR(build_plan(call, in, b));
  void* z_keep = buffers.saved != nullptr ? b.z_pool : nullptr;  // z is kept only for a backward
  MEGAMOE_RETURN_IF_ERROR(gate_up(s, TokenRows{in.x}, in.w13, z_keep, b.a_pool));
  MEGAMOE_RETURN_IF_ERROR(down(s, in.w2, in.topk_weights));
  if (down_writes_pool_rows(call, b, nullptr))
    return combine_pool_rows(b.hidden_pool, b.plan.route_row, in.topk_idx, d.tokens, d.top_k, d.num_experts,
                             d.hidden, b.plan.error_key, call.errors, y, call.stream);
  return combine_slots(b.slots, in.topk_idx, d.tokens, d.top_k, d.num_experts, d.hidden, b.plan.error_key,
                       call.errors, y, call.stream);
}

Status layer_backward(const LayerCall& call, const LayerInputs& in, const void* dy, const LayerGrads& grads,
                      const LayerBuffers& buffers) {
  CallBuffers b;
  MEGAMOE_RETURN_IF_ERROR(begin(call, in, buffers, true, &b));
  const LayerDims& d = call.dims;
  const LayerStep s{call, b, sm_count(call.device)};
  if (buffers.saved == nullptr) {  // nothing saved: rebuild the plan and z in scratch, as the forward made them
    MEGAMOE_RETURN_IF_ERROR(build_plan(call, in, b));
    MEGAMOE_RETURN_IF_ERROR(gate_up(s, TokenRows{in.x}, in.w13, b.z_pool, nullptr));
  }
  TokenRows dy_rows{dy}, x_rows{in.x};
  MEGAMOE_RETURN_IF_ERROR(down_grad(s, dy_rows, in.w2, in.topk_weights, grads.d_topk_weights));
  if (backward_side_jobs(call)) {
    // dW2 while the pool holds dy; kGateUpGrad scatters x into it meanwhile;
    // dW13 sums dx from kGateUpGrad's slots meanwhile.
    MEGAMOE_RETURN_IF_ERROR(down_weight_grad(s, dy_rows, grads));
    MEGAMOE_RETURN_IF_ERROR(gate_up_grad(s, in.w13, nullptr, &x_rows));
    const SideCombine dx = dx_side_combine(call, b, in.topk_idx, grads.dx);
    return gate_up_weight_grad(s, x_rows, grads, &dx);
  }
  MEGAMOE_RETURN_IF_ERROR(gate_up_grad(s, in.w13, nullptr, nullptr));
  // dx: the fixed-order sum of its slots.
  MEGAMOE_RETURN_IF_ERROR(combine_slots(b.slots, in.topk_idx, d.tokens, d.top_k, d.num_experts, d.hidden,
                                        b.plan.error_key, call.errors, grads.dx, call.stream));
  MEGAMOE_RETURN_IF_ERROR(down_weight_grad(s, dy_rows, grads));
  return gate_up_weight_grad(s, x_rows, grads);
}

}  // namespace megamoe::cuda
