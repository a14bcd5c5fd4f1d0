#include "cuda/moe/ep_layer.h"

#include <string>

#include "cuda/comm/combine.h"
#include "cuda/comm/ep_routing.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/moe/device_plan.h"
#include "cuda/moe/layer_kernels.h"
#include "cuda/moe/layer_parts.h"

namespace megamoe::cuda {
namespace {

struct EpScratch {
  uint32_t *dispatch_done, *combine_done;
  unsigned long long* error_key;
  int64_t* source_counts;
  int32_t* virtual_idx;
};

EpScratch ep_scratch(const EpGroup& ep) {
  const EpScratchLayout l = ep_scratch_layout(ep.layout);
  auto* base = static_cast<char*>(ep.scratch);
  return {reinterpret_cast<uint32_t*>(base + l.dispatch_done), reinterpret_cast<uint32_t*>(base + l.combine_done),
          reinterpret_cast<unsigned long long*>(base + l.error_key), reinterpret_cast<int64_t*>(base + l.source_counts),
          reinterpret_cast<int32_t*>(base + l.virtual_idx)};
}

// What every phase checks: the group, the call's dims against it, the inputs.
Status check_ep_call(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens) {
  const DispatchLayout& l = ep.layout;
  const LayerDims& d = call.dims;
  if (ep.view.world < 1 || ep.view.world > 8 || l.world != ep.view.world)
    return invalid_argument("EP layer: world " + std::to_string(ep.view.world) + " (layout: " +
                            std::to_string(l.world) + "); 1 to 8 ranks");
  if (ep.num_experts < l.world || ep.num_experts % l.world != 0)
    return invalid_argument("EP layer: " + std::to_string(ep.num_experts) + " experts do not split evenly over " +
                            std::to_string(l.world) + " ranks");
  if (ep.epoch == 0) return invalid_argument("EP layer: epoch 0 is the flags' initial value; start at 1");
  if (ep.scratch == nullptr || reinterpret_cast<uintptr_t>(ep.scratch) % kBufferAlign != 0)
    return invalid_argument("EP layer: the EP scratch is missing or not 256-byte aligned");
  if (tokens < 0 || tokens > l.max_tokens)
    return capacity_error("EP layer: " + std::to_string(tokens) + " tokens on rank " + std::to_string(ep.view.rank) +
                          ", but the group's buffers hold " + std::to_string(l.max_tokens) + " per rank");
  const LayerDims want = ep_owner_dims(ep, d.intermediate);
  if (d.tokens != want.tokens || d.num_experts != want.num_experts || d.top_k != want.top_k || d.hidden != want.hidden)
    return invalid_argument("EP layer: the call's dims are not ep_owner_dims (" + std::to_string(d.tokens) +
                            " virtual tokens, " + std::to_string(d.num_experts) + " local experts)");
  if (in.x == nullptr || in.topk_idx == nullptr || in.topk_weights == nullptr || in.w13 == nullptr ||
      in.w2 == nullptr)
    return invalid_argument("EP layer: an input pointer is null");
  return Status::Ok();
}

}  // namespace

EpScratchLayout ep_scratch_layout(const DispatchLayout& layout) {
  EpScratchLayout s;
  s.virtual_idx = s.source_counts + ((static_cast<size_t>(layout.world) * 8 + 255) & ~size_t{255});
  s.bytes = s.virtual_idx + static_cast<size_t>(layout.world) * layout.max_tokens * layout.top_k * 4;
  s.bytes = (s.bytes + 255) & ~size_t{255};
  return s;
}

LayerDims ep_owner_dims(const EpGroup& ep, int64_t intermediate) {
  LayerDims d;
  d.tokens = static_cast<int64_t>(ep.layout.world) * ep.layout.max_tokens;
  d.hidden = ep.layout.hidden;
  d.intermediate = intermediate;
  d.num_experts = ep.layout.world > 0 ? ep.num_experts / ep.layout.world : 0;
  d.top_k = ep.layout.top_k;
  return d;
}

Status ep_forward_send(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens) {
  MEGAMOE_RETURN_IF_ERROR(check_ep_call(call, ep, in, tokens));
  const EpScratch s = ep_scratch(ep);
  MEGAMOE_RETURN_IF_ERROR(check_routing(in.topk_idx, tokens, ep.layout.top_k, ep.num_experts, s.error_key, call.stream));
  DispatchArgs a;
  a.x = in.x, a.topk_idx = in.topk_idx, a.topk_weights = in.topk_weights, a.tokens = tokens;
  a.experts_per_rank = call.dims.num_experts, a.epoch = ep.epoch, a.blocks_done = s.dispatch_done;
  return dispatch_push(ep.view, ep.layout, a, call.stream);
}

Status ep_forward_experts(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens,
                          const LayerBuffers& buffers) {
  MEGAMOE_RETURN_IF_ERROR(check_ep_call(call, ep, in, tokens));
  if (buffers.saved != nullptr) return unimplemented("EP layer: no backward yet, so nothing is saved");
  const LayerDims& d = call.dims;  // V virtual tokens, L local experts
  const int64_t H = d.hidden, I = d.intermediate, L = d.num_experts;
  const EpScratch s = ep_scratch(ep);
  detail::Carved c;
  MEGAMOE_RETURN_IF_ERROR(detail::carve(call, buffers, &c));
  const int64_t C = c.capacity;
  const int sms = detail::sm_count(call.device);

  EpRoutingArgs r;
  r.buffer = ep.view.local, r.rank = ep.view.rank, r.own_topk_idx = in.topk_idx, r.own_tokens = tokens;
  r.experts_per_rank = static_cast<int>(L), r.epoch = ep.epoch, r.errors = call.errors;
  r.source_counts = s.source_counts, r.virtual_idx = s.virtual_idx;
  MEGAMOE_RETURN_IF_ERROR(build_ep_virtual_routing(ep.layout, r, call.stream));
  MEGAMOE_RETURN_IF_ERROR(build_device_plan(s.virtual_idx, d.tokens, d.top_k, d.num_experts, c.pv.plan, call.stream));
  const DevicePlan plan = detail::device_plan(c.pv.plan, d);
  MEGAMOE_RETURN_IF_ERROR(gather_ep_rows(ep.layout, ep.view.local, ep.view.rank, in.x, c.pv.plan.row_src,
                                         plan.pool_rows, C, c.xdy_pool, call.stream));

  GroupedGemmArgs g1 = detail::pool_gemm(GemmMode::kGateUp, call, plan, C, c.xdy_pool, H, in.w13, L * 2 * I, H, I);
  g1.out1 = c.a_pool;  // z is not kept: no backward yet
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g1, sms, call.stream));
  // Route (v, j)'s weight sits at v * k + j of the weights the dispatch delivered.
  GroupedGemmArgs g2 = detail::pool_gemm(GemmMode::kDown, call, plan, C, c.a_pool, I, in.w2, L * H, I, H);
  g2.topk_weights =
      reinterpret_cast<const float*>(static_cast<const char*>(ep.view.local) + ep.layout.weights_offset());
  g2.out0 = c.slots;  // [k][V][H]: combine_push's outputs
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g2, sms, call.stream));

  CombineArgs ca;
  ca.outputs = c.slots, ca.virtual_idx = s.virtual_idx, ca.source_counts = s.source_counts;
  ca.epoch = ep.epoch, ca.blocks_done = s.combine_done;
  return combine_push(ep.view, ep.layout, ca, call.stream);
}

Status ep_forward_combine(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens, void* y) {
  MEGAMOE_RETURN_IF_ERROR(check_ep_call(call, ep, in, tokens));
  if (y == nullptr) return invalid_argument("EP layer: y is null");
  const EpScratch s = ep_scratch(ep);
  // A missing owner poisons y (NaN) besides the report: never stale slots summed.
  MEGAMOE_RETURN_IF_ERROR(combine_wait(ep.layout, ep.view.local, ep.epoch, call.errors, call.stream, s.error_key));
  const void* slots = static_cast<const char*>(ep.view.local) + ep.layout.combine_slots_offset();
  return combine_slots(slots, in.topk_idx, tokens, ep.layout.top_k, ep.num_experts, ep.layout.hidden, s.error_key,
                       call.errors, y, call.stream);
}

Status layer_forward_ep(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens, void* y,
                        const LayerBuffers& buffers) {
  MEGAMOE_RETURN_IF_ERROR(ep_forward_send(call, ep, in, tokens));
  MEGAMOE_RETURN_IF_ERROR(ep_forward_experts(call, ep, in, tokens, buffers));
  return ep_forward_combine(call, ep, in, tokens, y);
}

}  // namespace megamoe::cuda
