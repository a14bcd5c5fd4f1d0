#include "cuda/layer/call_buffers.h"

namespace megamoe::cuda {
namespace {

template <typename T>
T* at(void* base, const Region& r) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + r.offset);
}
// A region that may be empty (the call's precision does not use it): null then.
template <typename T>
T* maybe(void* base, const Region& r) {
  return r.bytes > 0 && base != nullptr ? at<T>(base, r) : nullptr;
}

// The plan region (saved layout), starting at `base`.
DevicePlanBuffers plan_at(void* base, const SavedLayout& s, int32_t* chunk_counts) {
  DevicePlanBuffers p;
  p.error_key = at<unsigned long long>(base, s.error_key);
  p.chunk_counts = chunk_counts;
  p.expert_rows = at<int32_t>(base, s.expert_rows);
  p.expert_offset = at<int32_t>(base, s.expert_offset);
  p.tile_expert = at<int32_t>(base, s.tile_expert);
  p.route_row = at<int32_t>(base, s.route_row);
  p.row_src = at<int32_t>(base, s.row_src);
  return p;
}

DevicePlan gemm_plan_of(const DevicePlanBuffers& b, const LayerDims& d) {
  DevicePlan p;
  p.pool_rows = b.expert_offset + d.num_experts;
  p.tile_expert = b.tile_expert;
  p.expert_offset = b.expert_offset;
  p.expert_rows = b.expert_rows;
  p.row_src = b.row_src;
  p.route_row = b.route_row;
  p.num_tokens = static_cast<int>(d.tokens);
  p.top_k = d.top_k;
  p.num_experts = d.num_experts;
  return p;
}

Fp8Operands fp8_operands_at(void* scratch, const Fp8Layout& l) {
  auto q = [&](const Region& r) { return maybe<uint8_t>(scratch, r); };
  auto s = [&](const Region& r) { return maybe<float>(scratch, r); };
  Fp8Operands f;
  f.x_q = q(l.x_q), f.a_q = q(l.a_q), f.dy_q = q(l.dy_q), f.dz_q = q(l.dz_q);
  f.dy_t = q(l.dy_t), f.wa_t = q(l.wa_t), f.dz_t = q(l.dz_t), f.x_t = q(l.x_t);
  f.x_s = s(l.x_s), f.a_s = s(l.a_s), f.dy_s = s(l.dy_s), f.dz_s = s(l.dz_s);
  f.dy_ts = s(l.dy_ts), f.wa_ts = s(l.wa_ts), f.dz_ts = s(l.dz_ts), f.x_ts = s(l.x_ts);
  return f;
}

}  // namespace

Status carve_fp8_weights(const LayerDims& dims, void* buffer, Fp8WeightRegions* out) {
  Fp8WeightLayout wl;
  MEGAMOE_RETURN_IF_ERROR(fp8_weight_layout(dims, &wl));
  // (no buffer: an fp8_bwd forward, which reads none)
  out->w13_q = maybe<uint8_t>(buffer, wl.w13_q), out->w2_q = maybe<uint8_t>(buffer, wl.w2_q);
  out->w13_t = maybe<uint8_t>(buffer, wl.w13_t), out->w2_t = maybe<uint8_t>(buffer, wl.w2_t);
  out->w13_s = maybe<float>(buffer, wl.w13_s), out->w2_s = maybe<float>(buffer, wl.w2_s);
  return Status::Ok();
}

Status carve_call_buffers(const LayerCall& call, const LayerBuffers& b, CallBuffers* out) {
  const LayerDims& d = call.dims;
  ScratchLayout sl;
  MEGAMOE_RETURN_IF_ERROR(scratch_layout(d, b.saved == nullptr, &sl, call.slots_at_sources));
  CallBuffers c;
  MEGAMOE_RETURN_IF_ERROR(pool_capacity(d, &c.capacity));
  auto* chunk_counts = at<int32_t>(b.scratch, sl.chunk_counts);
  if (b.saved != nullptr) {
    SavedLayout s;
    MEGAMOE_RETURN_IF_ERROR(saved_layout(d, &s));
    c.plan = plan_at(b.saved, s, chunk_counts);
    c.z_pool = at<void>(b.saved, s.z_pool);
  } else {
    void* base = static_cast<char*>(b.scratch) + sl.plan_offset;
    c.plan = plan_at(base, sl.plan, chunk_counts);
    c.z_pool = at<void>(base, sl.plan.z_pool);
  }
  c.gemm_plan = gemm_plan_of(c.plan, d);
  c.hidden_pool = maybe<void>(b.scratch, sl.hidden_pool);
  c.a_pool = at<void>(b.scratch, sl.a_pool);
  c.dz_pool = at<void>(b.scratch, sl.dz_pool);
  c.dw_partial = at<float>(b.scratch, sl.dw_partial);
  c.slots = call.slots_at_sources ? nullptr : at<void>(b.scratch, sl.slots);
  c.fp8 = fp8_operands_at(b.scratch, sl.fp8);
  MEGAMOE_RETURN_IF_ERROR(carve_fp8_weights(d, b.fp8_weights, &c.fp8_weights));
  *out = c;
  return Status::Ok();
}

}  // namespace megamoe::cuda
