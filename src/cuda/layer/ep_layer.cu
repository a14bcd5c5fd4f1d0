#include "cuda/layer/ep_layer.h"

#include <string>

#include "cuda/comm/combine.h"
#include "cuda/comm/ep_routing.h"
#include "cuda/common/cuda_status.h"
#include "cuda/fp8/quantize.h"
#include "cuda/layer/fp8_weights.h"
#include "cuda/layer/layer_kernels.h"
#include "cuda/layer/layer_steps.h"
#include "cuda/plan/device_plan.h"

namespace megamoe::cuda {
namespace {

struct EpScratch {
  uint32_t *dispatch_done, *combine_done;
  unsigned long long* error_key;
  int64_t* source_counts;
  int32_t* virtual_idx;
  float* route_values;
};

EpScratch ep_scratch(const EpGroup& ep) {
  const EpScratchLayout l = ep_scratch_layout(ep.layout);
  auto* base = static_cast<char*>(ep.scratch);
  return {reinterpret_cast<uint32_t*>(base + l.dispatch_done), reinterpret_cast<uint32_t*>(base + l.combine_done),
          reinterpret_cast<unsigned long long*>(base + l.error_key), reinterpret_cast<int64_t*>(base + l.source_counts),
          reinterpret_cast<int32_t*>(base + l.virtual_idx), reinterpret_cast<float*>(base + l.route_values)};
}

struct EpSaved {
  int64_t* source_counts;
  int32_t* virtual_idx;
  float* weights;
};

EpSaved ep_saved_view(const EpGroup& ep, const void* saved) {
  const EpSavedLayout l = ep_saved_layout(ep.layout);
  auto* base = static_cast<char*>(const_cast<void*>(saved));
  return {reinterpret_cast<int64_t*>(base + l.source_counts), reinterpret_cast<int32_t*>(base + l.virtual_idx),
          reinterpret_cast<float*>(base + l.weights)};
}

// The forward's routing: kept for the backward (ep_saved), or in scratch.
EpSaved kept_routing(const EpCall& c) {
  if (c.ep_saved != nullptr) return ep_saved_view(c.ep, c.ep_saved);
  const EpScratch s = ep_scratch(c.ep);
  return {s.source_counts, s.virtual_idx, nullptr};
}

size_t align256(size_t n) { return (n + 255) & ~size_t{255}; }

// What every phase relies on: the group, the call's dims against it, the inputs.
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
  // An owner's scratch is laid out as one (scratch_layout's ep_owner: its pool receives rows).
  if (!call.slots_at_sources)
    return invalid_argument("EP layer: the owner's call was not prepared with slots_at_sources = true");
  if (ep.scratch == nullptr || reinterpret_cast<uintptr_t>(ep.scratch) % kBufferAlign != 0)
    return invalid_argument("EP layer: the EP scratch is missing or not 256-byte aligned");
  if (tokens < 0 || tokens > l.max_tokens)
    return capacity_error("EP layer: " + std::to_string(tokens) + " tokens on rank " + std::to_string(ep.view.rank) +
                          ", but the group's buffers hold " + std::to_string(l.max_tokens) + " per rank");
  const LayerDims want = ep_owner_dims(ep, d.intermediate);
  if (d.tokens != want.tokens || d.num_experts != want.num_experts || d.top_k != want.top_k || d.hidden != want.hidden)
    return invalid_argument("EP layer: the call's dims are not ep_owner_dims (" + std::to_string(d.tokens) +
                            " virtual tokens, " + std::to_string(d.num_experts) + " local experts)");
  // A rank with no tokens still takes part (PyTorch gives its empty tensors null pointers).
  if ((tokens > 0 && (in.x == nullptr || in.topk_idx == nullptr || in.topk_weights == nullptr)) || in.w13 == nullptr ||
      in.w2 == nullptr)
    return invalid_argument("EP layer: an input pointer is null");
  return Status::Ok();
}

Status check_backward(const EpCall& c) {
  if (c.buffers.saved == nullptr || c.ep_saved == nullptr)
    return invalid_argument("EP layer: the backward needs the forward's saved buffer and ep_saved");
  if (c.ep.epoch == ~uint32_t{0}) return invalid_argument("EP layer: the backward needs two epochs; ep.epoch is the last");
  return Status::Ok();
}

LayerStep step_of(const EpCall& c) { return LayerStep{c.owner, c.buf, sm_count(c.owner.device)}; }

}  // namespace

EpScratchLayout ep_scratch_layout(const DispatchLayout& layout) {
  const size_t routes = static_cast<size_t>(layout.world) * layout.max_tokens * layout.top_k;
  EpScratchLayout s;
  s.virtual_idx = s.source_counts + align256(static_cast<size_t>(layout.world) * 8);
  s.route_values = s.virtual_idx + align256(routes * 4);
  s.bytes = s.route_values + align256(routes * 4);
  return s;
}

EpSavedLayout ep_saved_layout(const DispatchLayout& layout) {
  const size_t routes = static_cast<size_t>(layout.world) * layout.max_tokens * layout.top_k;
  EpSavedLayout s;
  s.virtual_idx = align256(static_cast<size_t>(layout.world) * 8);
  s.weights = s.virtual_idx + align256(routes * 4);
  s.bytes = s.weights + align256(routes * 4);
  return s;
}

PeerSlots ep_return_slots(const EpGroup& ep, const int64_t* source_counts) {
  PeerSlots p;
  p.rank_buffers = ep.view.peers;
  p.offset = ep.layout.combine_slots_offset();
  p.tokens_per_rank = ep.layout.max_tokens;
  p.source_counts = source_counts;
  return p;
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

Status make_ep_call(const LayerCall& owner_call, const EpGroup& ep, const LayerInputs& in, int64_t tokens,
                    const LayerBuffers& owner_buffers, void* ep_saved, EpCall* out) {
  MEGAMOE_RETURN_IF_ERROR(check_ep_call(owner_call, ep, in, tokens));
  if ((owner_buffers.saved == nullptr) != (ep_saved == nullptr))
    return invalid_argument("EP layer: what the backward needs is kept in both the owner's saved buffer and ep_saved, "
                            "or in neither");
  if (reinterpret_cast<uintptr_t>(ep_saved) % kBufferAlign != 0)
    return invalid_argument("EP layer: ep_saved must be 256-byte aligned");
  EpCall c;
  c.owner = owner_call, c.ep = ep, c.in = in, c.tokens = tokens, c.buffers = owner_buffers, c.ep_saved = ep_saved;
  MEGAMOE_RETURN_IF_ERROR(carve_call_buffers(owner_call, owner_buffers, &c.buf));
  *out = c;
  return Status::Ok();
}

// ---- forward --------------------------------------------------------------------

Status ep_forward_send(const EpCall& c) {
  const LayerCall& call = c.owner;
  const EpGroup& ep = c.ep;
  const EpScratch s = ep_scratch(ep);
  MEGAMOE_RETURN_IF_ERROR(
      check_routing(c.in.topk_idx, c.tokens, ep.layout.top_k, ep.num_experts, s.error_key, call.stream));
  DispatchArgs a;
  a.x = c.in.x, a.topk_idx = c.in.topk_idx, a.topk_weights = c.in.topk_weights, a.tokens = c.tokens;
  a.experts_per_rank = call.dims.num_experts, a.epoch = ep.epoch, a.blocks_done = s.dispatch_done;
  if (fp8_forward(call.dims)) {
    // FP8: the rows cross NVLink in e4m3 with their scales (e4m3_slot_bytes:
    // ~0.52 of bf16's bytes), quantised here into this rank's own slots
    // (unused otherwise), which its own gather reads too. Per row, as the
    // one-GPU layer's gathering quantizer: the owners' pools get its bytes.
    void* own_slots = static_cast<char*>(ep.view.local) + ep.layout.slot_offset(ep.view.rank, 0);
    DispatchArgs e4m3 = a;  // the push's checks before the first write into the buffer
    e4m3.x = own_slots, e4m3.row_bytes = e4m3_slot_bytes(ep.layout.hidden);
    MEGAMOE_RETURN_IF_ERROR(check_dispatch(ep.view, ep.layout, e4m3));
    MEGAMOE_RETURN_IF_ERROR(quantize_e4m3_rows_to_slots(c.in.x, c.tokens, ep.layout.hidden, fp8_scale_of(call.dims),
                                                        own_slots, static_cast<int64_t>(ep.layout.slot_bytes()),
                                                        call.stream));
    a = e4m3;
  } else {
    a.own_slot = true;  // own rows into own slots: the receive area becomes the whole virtual token matrix
  }
  return dispatch_push(ep.view, ep.layout, a, call.stream);
}

Status ep_forward_experts(const EpCall& c) {
  const LayerCall& call = c.owner;
  const EpGroup& ep = c.ep;
  const LayerDims& d = call.dims;  // V virtual tokens, L local experts
  MEGAMOE_RETURN_IF_ERROR(refresh_fp8_weights(call, c.buffers, c.buf.fp8_weights, c.in, fp8_forward(d)));
  const EpSaved kept = kept_routing(c);
  EpRoutingArgs r;
  r.buffer = ep.view.local, r.rank = ep.view.rank, r.own_topk_idx = c.in.topk_idx, r.own_tokens = c.tokens;
  r.experts_per_rank = d.num_experts, r.epoch = ep.epoch, r.errors = call.errors;
  r.source_counts = kept.source_counts, r.virtual_idx = kept.virtual_idx;
  MEGAMOE_RETURN_IF_ERROR(build_ep_virtual_routing(ep.layout, r, call.stream));
  // Route (v, j)'s weight sits at v * k + j of the weights the dispatch delivered
  // (here once every source is in); the backward keeps its own copy.
  const auto* weights =
      reinterpret_cast<const float*>(static_cast<const char*>(ep.view.local) + ep.layout.weights_offset());
  if (kept.weights != nullptr)
    MEGAMOE_RETURN_IF_ERROR(cuda_status("EP layer: keeping the routing weights",
                                        cudaMemcpyAsync(kept.weights, weights, d.tokens * d.top_k * sizeof(float),
                                                        cudaMemcpyDeviceToDevice, call.stream)));
  const CallBuffers& b = c.buf;
  MEGAMOE_RETURN_IF_ERROR(build_device_plan(kept.virtual_idx, d.tokens, d.top_k, d.num_experts, b.plan, call.stream));
  const LayerStep s = step_of(c);
  void* z_keep = c.buffers.saved != nullptr ? b.z_pool : nullptr;  // z is kept only for a backward
  const PeerSlots y_slots = ep_return_slots(ep, kept.source_counts);
  TokenRows x;
  if (fp8_forward(d)) {  // the e4m3 rows and scales the dispatch delivered, straight into fp8.x_q / x_s
    MEGAMOE_RETURN_IF_ERROR(gather_ep_rows_e4m3(ep.layout, ep.view.local, b.plan.row_src, b.gemm_plan.pool_rows,
                                                b.capacity, b.fp8.x_q, b.fp8.x_s, call.stream));
    x.quantized = true;
  } else {  // the receive area: the whole virtual token matrix [V, H] (own rows in own slots)
    x.tokens = static_cast<const char*>(ep.view.local) + DispatchLayout::kRecvOffset;
  }
  MEGAMOE_RETURN_IF_ERROR(gate_up(s, x, c.in.w13, z_keep, b.a_pool));
  MEGAMOE_RETURN_IF_ERROR(down(s, c.in.w2, weights, &y_slots));
  // The rows are in their sources' slots (after the GEMM, in stream order): only the flags go out.
  return combine_signal(ep.view, ep.layout, kept.source_counts, ep.epoch, call.stream);
}

Status ep_forward_combine(const EpCall& c, void* y) {
  if (y == nullptr && c.tokens > 0) return invalid_argument("EP layer: y is null");
  const EpGroup& ep = c.ep;
  const EpScratch s = ep_scratch(ep);
  // A missing owner poisons y (NaN) besides the report: never stale slots summed.
  MEGAMOE_RETURN_IF_ERROR(
      combine_wait(ep.layout, ep.view.local, ep.epoch, c.owner.errors, c.owner.stream, s.error_key));
  const void* slots = static_cast<const char*>(ep.view.local) + ep.layout.combine_slots_offset();
  return combine_slots(slots, c.in.topk_idx, c.tokens, ep.layout.top_k, ep.num_experts, ep.layout.hidden, s.error_key,
                       c.owner.errors, y, c.owner.stream, ep.layout.max_tokens);
}

Status layer_forward_ep(const EpCall& c, void* y) {
  MEGAMOE_RETURN_IF_ERROR(ep_forward_send(c));
  MEGAMOE_RETURN_IF_ERROR(ep_forward_experts(c));
  return ep_forward_combine(c, y);
}

// ---- backward ------------------------------------------------------------------

namespace {

// The backward's second epoch (x for dW13, and the owners' "read it" flags).
EpGroup second_epoch(const EpGroup& ep) {
  EpGroup e = ep;
  e.epoch = ep.epoch + 1;
  return e;
}

// Rows of `rows` (dy or x, [tokens, H]) to the ranks that need them, and (again:
// other layers' calls may have used the buffer since the forward) the routing.
Status send_rows(const EpCall& c, const EpGroup& ep, const void* rows) {
  const EpScratch s = ep_scratch(ep);
  MEGAMOE_RETURN_IF_ERROR(
      check_routing(c.in.topk_idx, c.tokens, ep.layout.top_k, ep.num_experts, s.error_key, c.owner.stream));
  DispatchArgs a;
  a.x = rows, a.topk_idx = c.in.topk_idx, a.tokens = c.tokens;
  a.experts_per_rank = c.owner.dims.num_experts, a.epoch = ep.epoch, a.blocks_done = s.dispatch_done;
  return dispatch_push(ep.view, ep.layout, a, c.owner.stream);
}

// A source whose token count now differs from the forward's (it was missing
// then, or brings another batch) is treated as missing now: its rows gather
// as NaN and it gets no return flag, so its own wait names this rank and
// poisons its outputs, rather than rows landing where the saved plan no
// longer says.
__global__ void reconcile_counts_kernel(int64_t* now, const int64_t* forward, int world) {
  const int s = threadIdx.x;
  if (s < world && now[s] != forward[s]) now[s] = -1;
}

// Waits (bounded, naming a missing rank) until every source's rows of this
// epoch are in, then fills the owner's hidden pool with them along the saved plan.
Status receive_rows(const EpCall& c, const EpGroup& ep, const void* own_rows) {
  const EpScratch s = ep_scratch(ep);
  const LayerCall& call = c.owner;
  EpRoutingArgs r;
  r.buffer = ep.view.local, r.rank = ep.view.rank, r.own_topk_idx = c.in.topk_idx, r.own_tokens = c.tokens;
  r.experts_per_rank = call.dims.num_experts, r.epoch = ep.epoch, r.errors = call.errors;
  r.source_counts = s.source_counts, r.virtual_idx = s.virtual_idx;  // the wait; the saved routing is the forward's
  MEGAMOE_RETURN_IF_ERROR(build_ep_virtual_routing(ep.layout, r, call.stream));
  reconcile_counts_kernel<<<1, 32, 0, call.stream>>>(s.source_counts, kept_routing(c).source_counts, ep.layout.world);
  MEGAMOE_RETURN_IF_ERROR(cuda_status("EP layer: token counts against the forward's", cudaGetLastError()));
  return gather_ep_rows(ep.layout, ep.view.local, ep.view.rank, own_rows, c.buf.plan.row_src, c.buf.gemm_plan.pool_rows,
                        c.buf.capacity, c.buf.hidden_pool, call.stream, s.source_counts);
}

}  // namespace

Status ep_backward_send_dy(const EpCall& c, const void* dy) {
  if (dy == nullptr && c.tokens > 0) return invalid_argument("EP layer: dy is null");
  return send_rows(c, c.ep, dy);
}

Status ep_backward_experts(const EpCall& c, const void* dy_rows, const LayerGrads& grads) {
  MEGAMOE_RETURN_IF_ERROR(check_backward(c));
  if (grads.dw2 == nullptr || (dy_rows == nullptr && c.tokens > 0)) return invalid_argument("EP layer: dw2 or dy is null");
  const LayerCall& call = c.owner;
  const EpGroup& ep = c.ep;
  MEGAMOE_RETURN_IF_ERROR(refresh_fp8_weights(call, c.buffers, c.buf.fp8_weights, c.in, true));
  const EpScratch s = ep_scratch(ep);
  const EpSaved kept = kept_routing(c);
  MEGAMOE_RETURN_IF_ERROR(receive_rows(c, ep, dy_rows));  // this rank's own rows from its own dy
  // As the one-GPU backward, over the virtual tokens and with dy's rows in
  // the pool: kDownGrad (and the d topk_w values), kGateUpGrad into the
  // sources' return areas, dW2.
  const LayerStep st = step_of(c);
  const PeerSlots dx_slots = ep_return_slots(ep, s.source_counts);
  TokenRows dy;
  dy.in_pool = true;
  MEGAMOE_RETURN_IF_ERROR(down_grad(st, dy, c.in.w2, kept.weights, s.route_values));
  MEGAMOE_RETURN_IF_ERROR(gate_up_grad(st, c.in.w13, &dx_slots, nullptr));
  // dx rows are in their sources' slots; d topk_w and the flags go back before
  // dW2 runs: the sources' wait is not held up by it.
  CombineArgs ca;
  ca.outputs = nullptr, ca.virtual_idx = kept.virtual_idx, ca.source_counts = s.source_counts;
  ca.route_values = s.route_values, ca.epoch = ep.epoch, ca.blocks_done = s.combine_done;
  MEGAMOE_RETURN_IF_ERROR(combine_push(ep.view, ep.layout, ca, call.stream));
  return down_weight_grad(st, dy, grads);
}

Status ep_backward_combine(const EpCall& c, const LayerGrads& grads) {
  if (c.tokens > 0 && (grads.dx == nullptr || grads.d_topk_weights == nullptr))
    return invalid_argument("EP layer: dx or d_topk_weights is null");
  const EpGroup& ep = c.ep;
  const EpScratch s = ep_scratch(ep);
  const LayerCall& call = c.owner;
  MEGAMOE_RETURN_IF_ERROR(combine_wait(ep.layout, ep.view.local, ep.epoch, call.errors, call.stream, s.error_key));
  const void* slots = static_cast<const char*>(ep.view.local) + ep.layout.combine_slots_offset();
  MEGAMOE_RETURN_IF_ERROR(combine_slots(slots, c.in.topk_idx, c.tokens, ep.layout.top_k, ep.num_experts,
                                        ep.layout.hidden, s.error_key, call.errors, grads.dx, call.stream,
                                        ep.layout.max_tokens));
  return combine_route_values(ep.layout, ep.view.local, c.in.topk_idx, c.tokens, ep.num_experts, s.error_key,
                              grads.d_topk_weights, call.stream);
}

Status ep_backward_send_x(const EpCall& c) { return send_rows(c, second_epoch(c.ep), c.in.x); }

Status ep_backward_weight_grads(const EpCall& c, const LayerGrads& grads) {
  MEGAMOE_RETURN_IF_ERROR(check_backward(c));
  if (grads.dw13 == nullptr) return invalid_argument("EP layer: dw13 is null");
  const EpGroup e2 = second_epoch(c.ep);
  MEGAMOE_RETURN_IF_ERROR(receive_rows(c, e2, c.in.x));
  // The receive area is read: its sources may reuse it.
  MEGAMOE_RETURN_IF_ERROR(
      combine_signal(c.ep.view, c.ep.layout, ep_scratch(c.ep).source_counts, e2.epoch, c.owner.stream));
  TokenRows x;
  x.in_pool = true;
  return gate_up_weight_grad(step_of(c), x, grads);
}

Status ep_backward_finish(const EpCall& c) {
  return combine_wait(c.ep.layout, c.ep.view.local, c.ep.epoch + 1, c.owner.errors, c.owner.stream);
}

Status run_ep_phase(const EpCall& c, int phase, void* y, const void* dy, const LayerGrads& grads) {
  switch (phase) {
    case 0: return ep_forward_send(c);
    case 1: return ep_forward_experts(c);
    case 2: return ep_forward_combine(c, y);
    case 3: return ep_backward_send_dy(c, dy);
    case 4: return ep_backward_experts(c, dy, grads);
    case 5: return ep_backward_combine(c, grads);
    case 6: return ep_backward_send_x(c);
    case 7: return ep_backward_weight_grads(c, grads);
    case 8: return ep_backward_finish(c);
    default: return invalid_argument("EP layer: phase " + std::to_string(phase) + " is not 0 to 8");
  }
}

Status layer_backward_ep(const EpCall& c, const void* dy, const LayerGrads& grads) {
  MEGAMOE_RETURN_IF_ERROR(ep_backward_send_dy(c, dy));
  MEGAMOE_RETURN_IF_ERROR(ep_backward_experts(c, dy, grads));
  MEGAMOE_RETURN_IF_ERROR(ep_backward_combine(c, grads));
  MEGAMOE_RETURN_IF_ERROR(ep_backward_send_x(c));
  MEGAMOE_RETURN_IF_ERROR(ep_backward_weight_grads(c, grads));
  return ep_backward_finish(c);
}

}  // namespace megamoe::cuda
