#include "cuda/moe/ep_layer.h"

#include <algorithm>
#include <string>

#include "cuda/comm/combine.h"
#include "cuda/comm/ep_routing.h"
#include "cuda/common/cuda_status.h"
#include "cuda/fp8/quantize.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/moe/device_plan.h"
#include "cuda/moe/fp8_parts.h"
#include "cuda/moe/layer_kernels.h"
#include "cuda/moe/layer_parts.h"

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

size_t align256(size_t n) { return (n + 255) & ~size_t{255}; }

// Whether this call's forward rows stay in their sources' own slots for the
// owners to pull (EpGroup::pull_rows; FP8's forward always pushes its e4m3 rows).
bool pulls_rows(const EpGroup& ep, const LayerDims& d) { return ep.pull_rows && !detail::fp8_forward(d); }

// The owner's slot-writing GEMMs (kDown, kGateUpGrad) store each route's row
// straight into its source rank's return area (over NVLink for another GPU's):
// no copy of the k x V x H slot rows after the GEMM, and the transfer overlaps
// the GEMM's own compute.
// source_counts: this call's counts (the backward's reconciled with its forward's).
GroupedGemmArgs::PeerSlots return_slots(const EpGroup& ep, const int64_t* source_counts) {
  GroupedGemmArgs::PeerSlots p;
  p.rank_buffers = ep.view.peers;
  p.offset = ep.layout.combine_slots_offset();
  p.tokens_per_rank = ep.layout.max_tokens;
  p.source_counts = source_counts;
  return p;
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
  if (detail::fp8_forward(call.dims)) {
    // FP8: the rows cross NVLink in e4m3 with their scales (e4m3_slot_bytes:
    // ~0.52 of bf16's bytes), quantised here into this rank's own slots
    // (unused otherwise), which its own gather reads too. Per row, as the
    // one-GPU layer's gathering quantizer: the owners' pools get its bytes.
    void* own_slots = static_cast<char*>(ep.view.local) + ep.layout.slot_offset(ep.view.rank, 0);
    DispatchArgs e4m3 = a;  // the push's checks before the first write into the buffer
    e4m3.x = own_slots, e4m3.row_bytes = e4m3_slot_bytes(ep.layout.hidden);
    MEGAMOE_RETURN_IF_ERROR(check_dispatch(ep.view, ep.layout, e4m3));
    MEGAMOE_RETURN_IF_ERROR(quantize_e4m3_rows_to_slots(in.x, tokens, ep.layout.hidden,
                                                        detail::fp8_scale_of(call.dims), own_slots,
                                                        static_cast<int64_t>(ep.layout.slot_bytes()), call.stream));
    a = e4m3;
  } else {
    // Own rows into own slots, where the owners' kGateUp reads them (side jobs; pulled: every owner).
    a.rows_to_peers = !pulls_rows(ep, call.dims);
    a.own_slot = detail::kSideJobs || !a.rows_to_peers;
  }
  return dispatch_push(ep.view, ep.layout, a, call.stream);
}

Status ep_forward_experts(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens,
                          const LayerBuffers& buffers, void* ep_saved) {
  MEGAMOE_RETURN_IF_ERROR(check_ep_call(call, ep, in, tokens));
  if ((buffers.saved == nullptr) != (ep_saved == nullptr))
    return invalid_argument("EP layer: a forward for a backward needs both the owner's saved buffer and ep_saved");
  const LayerDims& d = call.dims;  // V virtual tokens, L local experts
  const int64_t H = d.hidden, I = d.intermediate, L = d.num_experts;
  const EpScratch s = ep_scratch(ep);
  detail::Carved c;
  MEGAMOE_RETURN_IF_ERROR(detail::carve(call, buffers, &c));
  detail::Fp8Carved f;  // null regions unless the precision quantises
  MEGAMOE_RETURN_IF_ERROR(detail::carve_fp8(call, buffers, &f));
  MEGAMOE_RETURN_IF_ERROR(detail::refresh_fp8_weights(call, buffers, f, in, detail::fp8_forward(d)));
  const int64_t C = c.capacity;
  const int sms = detail::sm_count(call.device);

  EpRoutingArgs r;
  r.buffer = ep.view.local, r.rank = ep.view.rank, r.own_topk_idx = in.topk_idx, r.own_tokens = tokens;
  r.experts_per_rank = static_cast<int>(L), r.epoch = ep.epoch, r.errors = call.errors;
  r.rows_pulled = pulls_rows(ep, d);  // a source that sent its rows the other way is named, and left out
  // Kept for the backward, or in scratch.
  const EpSaved kept = ep_saved != nullptr ? ep_saved_view(ep, ep_saved) : EpSaved{s.source_counts, s.virtual_idx, nullptr};
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
  MEGAMOE_RETURN_IF_ERROR(build_device_plan(kept.virtual_idx, d.tokens, d.top_k, d.num_experts, c.pv.plan, call.stream));
  const DevicePlan plan = detail::device_plan(c.pv.plan, d);
  void* z_keep = buffers.saved != nullptr ? c.pv.z_pool : nullptr;  // z is kept only for a backward
  const GroupedGemmArgs::PeerSlots y_slots = return_slots(ep, kept.source_counts);
  if (detail::fp8_forward(d)) {  // the e4m3 rows and scales the dispatch delivered, straight into f.x_q / f.x_s
    MEGAMOE_RETURN_IF_ERROR(gather_ep_rows_e4m3(ep.layout, ep.view.local, c.pv.plan.row_src, plan.pool_rows, C, f.x_q,
                                                f.x_s, call.stream));
    MEGAMOE_RETURN_IF_ERROR(detail::fp8_gate_up(call, plan, c, f, nullptr, in.w13, z_keep, c.a_pool, sms, true));
    MEGAMOE_RETURN_IF_ERROR(detail::fp8_down(call, plan, c, f, in.w2, weights, sms, &y_slots));
  } else {
    GroupedGemmArgs g1 = detail::pool_gemm(GemmMode::kGateUp, call, plan, C, c.xdy_pool, H, in.w13, L * 2 * I, H, I);
    g1.out0 = z_keep;
    g1.out1 = c.a_pool;
    // kGateUp gathers its pool itself in its idle producer warps, as on one
    // GPU (cuda_layer.cu's gate_up), from the receive area, which the send
    // made the whole virtual token matrix [V, H] (own rows in own slots);
    // each tile held until its 128 rows are in.
    bool gathered_by_gemm = false;
    if (detail::kSideJobs) {
      GroupedGemmArgs own = g1;
      const void* recv = static_cast<const char*>(ep.view.local) + DispatchLayout::kRecvOffset;
      MEGAMOE_RETURN_IF_ERROR(detail::gather_own_a(own, recv, c, call.stream));
      if (pulls_rows(ep, d)) {  // row v in its source's own slot: the same offset in that rank's buffer
        own.side_gather.src = nullptr;
        own.side_gather.source_buffers = ep.view.peers;
        own.side_gather.source_offset = DispatchLayout::kRecvOffset;
        own.side_gather.tokens_per_source = static_cast<int>(std::max<int64_t>(ep.layout.max_tokens, 1));
        own.side_gather.sources = ep.layout.world;
      }
      MEGAMOE_RETURN_IF_ERROR(detail::launch_holding_own_rows(own, sms, call.stream, &gathered_by_gemm));
    }
    if (!gathered_by_gemm) {
      MEGAMOE_RETURN_IF_ERROR(gather_ep_rows(ep.layout, ep.view.local, ep.view.rank, in.x, c.pv.plan.row_src,
                                             plan.pool_rows, C, c.xdy_pool, call.stream, nullptr,
                                             pulls_rows(ep, d) ? ep.view.peers : nullptr));
      MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g1, sms, call.stream));
    }
    GroupedGemmArgs g2 = detail::pool_gemm(GemmMode::kDown, call, plan, C, c.a_pool, I, in.w2, L * H, I, H);
    g2.topk_weights = weights;
    g2.peer_slots = y_slots;
    MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g2, sms, call.stream));
  }

  // The rows are in their sources' slots (after the GEMM, in stream order): only the flags go out.
  return combine_signal(ep.view, ep.layout, kept.source_counts, ep.epoch, call.stream);
}

Status ep_forward_combine(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens, void* y) {
  MEGAMOE_RETURN_IF_ERROR(check_ep_call(call, ep, in, tokens));
  if (y == nullptr && tokens > 0) return invalid_argument("EP layer: y is null");
  const EpScratch s = ep_scratch(ep);
  // A missing owner poisons y (NaN) besides the report: never stale slots summed.
  MEGAMOE_RETURN_IF_ERROR(combine_wait(ep.layout, ep.view.local, ep.epoch, call.errors, call.stream, s.error_key));
  const void* slots = static_cast<const char*>(ep.view.local) + ep.layout.combine_slots_offset();
  return combine_slots(slots, in.topk_idx, tokens, ep.layout.top_k, ep.num_experts, ep.layout.hidden, s.error_key,
                       call.errors, y, call.stream, ep.layout.max_tokens);
}

Status layer_forward_ep(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens, void* y,
                        const LayerBuffers& buffers, void* ep_saved) {
  MEGAMOE_RETURN_IF_ERROR(ep_forward_send(call, ep, in, tokens));
  MEGAMOE_RETURN_IF_ERROR(ep_forward_experts(call, ep, in, tokens, buffers, ep_saved));
  return ep_forward_combine(call, ep, in, tokens, y);
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
Status send_rows(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, const void* rows, int64_t tokens) {
  const EpScratch s = ep_scratch(ep);
  MEGAMOE_RETURN_IF_ERROR(check_routing(in.topk_idx, tokens, ep.layout.top_k, ep.num_experts, s.error_key, call.stream));
  DispatchArgs a;
  a.x = rows, a.topk_idx = in.topk_idx, a.tokens = tokens;
  a.experts_per_rank = call.dims.num_experts, a.epoch = ep.epoch, a.blocks_done = s.dispatch_done;
  return dispatch_push(ep.view, ep.layout, a, call.stream);
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
// epoch are in, then fills the owner's pool with them along the saved plan.
Status receive_rows(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, const void* own_rows,
                    int64_t tokens, const detail::Carved& c, const int64_t* forward_counts) {
  const EpScratch s = ep_scratch(ep);
  EpRoutingArgs r;
  r.buffer = ep.view.local, r.rank = ep.view.rank, r.own_topk_idx = in.topk_idx, r.own_tokens = tokens;
  r.experts_per_rank = call.dims.num_experts, r.epoch = ep.epoch, r.errors = call.errors;
  r.source_counts = s.source_counts, r.virtual_idx = s.virtual_idx;  // the wait; the saved routing is the forward's
  MEGAMOE_RETURN_IF_ERROR(build_ep_virtual_routing(ep.layout, r, call.stream));
  reconcile_counts_kernel<<<1, 32, 0, call.stream>>>(s.source_counts, forward_counts, ep.layout.world);
  MEGAMOE_RETURN_IF_ERROR(cuda_status("EP layer: token counts against the forward's", cudaGetLastError()));
  const DevicePlan plan = detail::device_plan(c.pv.plan, call.dims);
  return gather_ep_rows(ep.layout, ep.view.local, ep.view.rank, own_rows, c.pv.plan.row_src, plan.pool_rows,
                        c.capacity, c.xdy_pool, call.stream, s.source_counts);
}

Status check_backward(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens,
                      const LayerBuffers& buffers, const void* ep_saved) {
  MEGAMOE_RETURN_IF_ERROR(check_ep_call(call, ep, in, tokens));
  if (buffers.saved == nullptr || ep_saved == nullptr)
    return invalid_argument("EP layer: the backward needs the forward's saved buffer and ep_saved");
  if (reinterpret_cast<uintptr_t>(ep_saved) % kBufferAlign != 0)
    return invalid_argument("EP layer: ep_saved must be 256-byte aligned");
  if (ep.epoch == ~uint32_t{0}) return invalid_argument("EP layer: the backward needs two epochs; ep.epoch is the last");
  return Status::Ok();
}

}  // namespace

Status ep_backward_send_dy(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, const void* dy,
                           int64_t tokens) {
  MEGAMOE_RETURN_IF_ERROR(check_ep_call(call, ep, in, tokens));
  if (dy == nullptr && tokens > 0) return invalid_argument("EP layer: dy is null");
  return send_rows(call, ep, in, dy, tokens);
}

Status ep_backward_experts(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, const void* dy,
                           int64_t tokens, const LayerGrads& grads, const LayerBuffers& buffers,
                           const void* ep_saved) {
  MEGAMOE_RETURN_IF_ERROR(check_backward(call, ep, in, tokens, buffers, ep_saved));
  if (grads.dw2 == nullptr || (dy == nullptr && tokens > 0)) return invalid_argument("EP layer: dw2 or dy is null");
  const LayerDims& d = call.dims;
  const int64_t H = d.hidden, I = d.intermediate;
  const EpScratch s = ep_scratch(ep);
  const EpSaved kept = ep_saved_view(ep, ep_saved);
  detail::Carved c;
  MEGAMOE_RETURN_IF_ERROR(detail::carve(call, buffers, &c));
  detail::Fp8Carved f;  // null regions unless the precision quantises
  MEGAMOE_RETURN_IF_ERROR(detail::carve_fp8(call, buffers, &f));
  MEGAMOE_RETURN_IF_ERROR(detail::refresh_fp8_weights(call, buffers, f, in, true));
  const int64_t C = c.capacity;
  const int sms = detail::sm_count(call.device);
  const DevicePlan plan = detail::device_plan(c.pv.plan, d);
  MEGAMOE_RETURN_IF_ERROR(receive_rows(call, ep, in, dy, tokens, c, kept.source_counts));

  // As layer_backward, over the virtual tokens: ga = dy @ w2[e]; fused d topk_w
  // partials, dz, topk_w * a; then dx slots = dz @ w13[e]; dW2 = dy^T (w a).
  // FP8: the pool's dy rows quantised as one GPU quantises them; the e4m3
  // operand sets of the data gradients, dW2 and dW13 share one scratch area,
  // written in this stream's order (Fp8Layout).
  const GroupedGemmArgs::PeerSlots dx_slots = return_slots(ep, s.source_counts);
  if (detail::fp8_backward(d))
    MEGAMOE_RETURN_IF_ERROR(detail::fp8_data_grad_gemms(call, plan, c, f, nullptr, in.w2, in.w13, kept.weights,
                                                        s.route_values, sms, &dx_slots, true));
  else
    MEGAMOE_RETURN_IF_ERROR(
        detail::data_grad_gemms(call, plan, c, in.w2, in.w13, kept.weights, s.route_values, sms, &dx_slots));
  // dx rows are in their sources' slots; d topk_w and the flags go back before
  // dW2 runs: the sources' wait is not held up by it.
  CombineArgs ca;
  ca.outputs = nullptr, ca.virtual_idx = kept.virtual_idx, ca.source_counts = s.source_counts;
  ca.route_values = s.route_values, ca.epoch = ep.epoch, ca.blocks_done = s.combine_done;
  MEGAMOE_RETURN_IF_ERROR(combine_push(ep.view, ep.layout, ca, call.stream));
  return detail::weight_grad_gemm(call, plan, C, c.xdy_pool, H, f.dy_t, f.dy_ts, c.a_pool, I, f.wa_t, f.wa_ts,
                                  grads.dw2, grads, sms);
}

Status ep_backward_combine(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens,
                           const LayerGrads& grads) {
  MEGAMOE_RETURN_IF_ERROR(check_ep_call(call, ep, in, tokens));
  if (tokens > 0 && (grads.dx == nullptr || grads.d_topk_weights == nullptr))
    return invalid_argument("EP layer: dx or d_topk_weights is null");
  const EpScratch s = ep_scratch(ep);
  MEGAMOE_RETURN_IF_ERROR(combine_wait(ep.layout, ep.view.local, ep.epoch, call.errors, call.stream, s.error_key));
  const void* slots = static_cast<const char*>(ep.view.local) + ep.layout.combine_slots_offset();
  MEGAMOE_RETURN_IF_ERROR(combine_slots(slots, in.topk_idx, tokens, ep.layout.top_k, ep.num_experts, ep.layout.hidden,
                                        s.error_key, call.errors, grads.dx, call.stream, ep.layout.max_tokens));
  return combine_route_values(ep.layout, ep.view.local, in.topk_idx, tokens, ep.num_experts, s.error_key,
                              grads.d_topk_weights, call.stream);
}

Status ep_backward_send_x(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens) {
  MEGAMOE_RETURN_IF_ERROR(check_ep_call(call, ep, in, tokens));
  return send_rows(call, second_epoch(ep), in, in.x, tokens);
}

Status ep_backward_weight_grads(const LayerCall& call, const EpGroup& ep, const LayerInputs& in, int64_t tokens,
                                const LayerGrads& grads, const LayerBuffers& buffers, const void* ep_saved) {
  MEGAMOE_RETURN_IF_ERROR(check_backward(call, ep, in, tokens, buffers, ep_saved));
  if (grads.dw13 == nullptr) return invalid_argument("EP layer: dw13 is null");
  const EpGroup e2 = second_epoch(ep);
  detail::Carved c;
  MEGAMOE_RETURN_IF_ERROR(detail::carve(call, buffers, &c));
  detail::Fp8Carved f;  // null regions unless the precision quantises
  MEGAMOE_RETURN_IF_ERROR(detail::carve_fp8(call, buffers, &f));
  const DevicePlan plan = detail::device_plan(c.pv.plan, call.dims);
  MEGAMOE_RETURN_IF_ERROR(receive_rows(call, e2, in, in.x, tokens, c, ep_saved_view(ep, ep_saved).source_counts));
  // The receive area is read: its sources may reuse it.
  MEGAMOE_RETURN_IF_ERROR(combine_signal(ep.view, ep.layout, ep_scratch(ep).source_counts, e2.epoch, call.stream));
  const int64_t H = call.dims.hidden, I = call.dims.intermediate;
  // FP8: dz^T and x^T quantised by 128 pool rows of each column.
  return detail::weight_grad_gemm(call, plan, c.capacity, c.dz_pool, 2 * I, f.dz_t, f.dz_ts, c.xdy_pool, H, f.x_t,
                                  f.x_ts, grads.dw13, grads, detail::sm_count(call.device));
}

Status ep_backward_finish(const LayerCall& call, const EpGroup& ep) {
  (void)call.dims;
  if (ep.epoch == 0 || ep.epoch == ~uint32_t{0}) return invalid_argument("EP layer: a bad epoch");
  return combine_wait(ep.layout, ep.view.local, ep.epoch + 1, call.errors, call.stream);
}

}  // namespace megamoe::cuda
