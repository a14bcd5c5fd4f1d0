#include "cuda/moe/layer_parts.h"

#include "cuda/common/cuda_status.h"
#include "cuda/moe/layer_kernels.h"

namespace megamoe::cuda::detail {

namespace {

template <typename T>
T* at(void* base, const Region& r) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + r.offset);
}

PlanView plan_view(void* base, const SavedLayout& s, int32_t* chunk_counts) {
  PlanView v;
  v.plan.error_key = at<unsigned long long>(base, s.error_key);
  v.plan.chunk_counts = chunk_counts;
  v.plan.expert_rows = at<int32_t>(base, s.expert_rows);
  v.plan.expert_offset = at<int32_t>(base, s.expert_offset);
  v.plan.tile_expert = at<int32_t>(base, s.tile_expert);
  v.plan.route_row = at<int32_t>(base, s.route_row);
  v.plan.row_src = at<int32_t>(base, s.row_src);
  v.z_pool = at<void>(base, s.z_pool);
  return v;
}

}  // namespace

Status carve(const LayerCall& call, const LayerBuffers& b, Carved* c) {
  ScratchLayout sl;
  MEGAMOE_RETURN_IF_ERROR(scratch_layout(call.dims, b.saved == nullptr, &sl, call.slots_at_sources));
  MEGAMOE_RETURN_IF_ERROR(pool_capacity(call.dims, &c->capacity));
  auto* chunk_counts = at<int32_t>(b.scratch, sl.chunk_counts);
  if (b.saved != nullptr) {
    SavedLayout s;
    MEGAMOE_RETURN_IF_ERROR(saved_layout(call.dims, &s));
    c->pv = plan_view(b.saved, s, chunk_counts);
  } else {
    c->pv = plan_view(static_cast<char*>(b.scratch) + sl.plan_offset, sl.plan, chunk_counts);
  }
  c->xdy_pool = sl.xdy_pool.bytes > 0 ? at<void>(b.scratch, sl.xdy_pool) : nullptr;  // none: one-GPU fp8
  c->a_pool = at<void>(b.scratch, sl.a_pool);
  c->slots = call.slots_at_sources ? nullptr : at<void>(b.scratch, sl.slots);
  c->dz_pool = at<void>(b.scratch, sl.dz_pool);
  c->dw_partial = at<float>(b.scratch, sl.dw_partial);
  return Status::Ok();
}

Status carve_fp8(const LayerCall& call, const LayerBuffers& b, Fp8Carved* f) {
  ScratchLayout sl;
  MEGAMOE_RETURN_IF_ERROR(scratch_layout(call.dims, b.saved == nullptr, &sl, call.slots_at_sources));
  const Fp8Layout& l = sl.fp8;
  auto q = [&](const Region& r) { return r.bytes > 0 ? at<uint8_t>(b.scratch, r) : nullptr; };
  auto s = [&](const Region& r) { return r.bytes > 0 ? at<float>(b.scratch, r) : nullptr; };
  *f = Fp8Carved{q(l.x_q),   q(l.a_q),   nullptr,    nullptr,    nullptr,    nullptr,    q(l.dy_q),  q(l.dz_q),
                 q(l.dy_t),  q(l.wa_t),  q(l.dz_t),  q(l.x_t),   s(l.x_s),   s(l.a_s),   nullptr,    nullptr,
                 s(l.dy_s),  s(l.dz_s),  s(l.dy_ts), s(l.wa_ts), s(l.dz_ts), s(l.x_ts)};
  return carve_fp8_weights(call.dims, b.fp8_weights, f);
}

Status carve_fp8_weights(const LayerDims& dims, void* buffer, Fp8Carved* f) {
  Fp8WeightLayout wl;
  MEGAMOE_RETURN_IF_ERROR(fp8_weight_layout(dims, &wl));
  // (no buffer: an fp8_bwd forward, which reads none)
  auto q = [&](const Region& r) { return r.bytes > 0 && buffer != nullptr ? at<uint8_t>(buffer, r) : nullptr; };
  auto s = [&](const Region& r) { return r.bytes > 0 && buffer != nullptr ? at<float>(buffer, r) : nullptr; };
  f->w13_q = q(wl.w13_q), f->w2_q = q(wl.w2_q), f->w13_t = q(wl.w13_t), f->w2_t = q(wl.w2_t);
  f->w13_s = s(wl.w13_s), f->w2_s = s(wl.w2_s);
  return Status::Ok();
}

int sm_count(int device) {
  static int counts[64] = {};
  if (device < 0 || device >= 64) return 132;
  if (counts[device] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    counts[device] = n > 0 ? n : 132;
  }
  return counts[device];
}

DevicePlan device_plan(const DevicePlanBuffers& b, const LayerDims& d) {
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

// Experts whose weights (B) pass this many bytes walk their tiles rows first
// (GroupedGemmArgs::rows_first): concurrently running tiles then read a few
// column tiles of B instead of all of it (Mixtral's w13: 235 MB an expert,
// against the H200's 50 MB of L2). megamoe-gemm-bench, session 36: Mixtral's
// kGateUp -27%, kDownGrad -13%; Qwen3-235B-A22B (w13 25 MB, w2 13 MB) -1..-2%
// in all four modes; Qwen3-30B-A3B (w13 6 MB) +8..+14%, so it stays below.
// (-DMEGAMOE_ROWS_FIRST=OFF: never, to measure against.)
constexpr int64_t kRowsFirstWeightBytes = int64_t{10} << 20;
#ifdef MEGAMOE_ROWS_FIRST
constexpr bool kRowsFirst = true;
#else
constexpr bool kRowsFirst = false;
#endif

bool prefers_rows_first(const DevicePlan& plan, int64_t b_rows, int64_t b_cols, int elem_bytes) {
  return kRowsFirst && plan.num_experts > 0 && b_rows / plan.num_experts * b_cols * elem_bytes > kRowsFirstWeightBytes;
}

GroupedGemmArgs pool_gemm(GemmMode mode, const LayerCall& call, const DevicePlan& plan, int64_t capacity,
                          const void* a, int64_t k, const void* b, int64_t b_rows, int64_t b_cols, int64_t n) {
  GroupedGemmArgs g;
  g.rows_first = prefers_rows_first(plan, b_rows, b_cols, 2);  // bf16 weights (use_fp8 decides again for e4m3)
  g.mode = mode;
  g.plan = plan;
  g.n = n;
  g.k = k;
  g.intermediate = call.dims.intermediate;
  g.a = a, g.a_rows = capacity, g.a_cols = k;
  g.b = b, g.b_rows = b_rows, g.b_cols = b_cols;
  g.errors = call.errors;
  return g;
}

// dW[e] = A_pool^T @ B_pool over each expert's rows.
GroupedGemmArgs weight_grad(const LayerCall& call, const DevicePlan& plan, int64_t capacity, const void* a,
                            int64_t m, const void* b, int64_t n, void* out, const LayerGrads& grads) {
  GroupedGemmArgs g;
  g.mode = GemmMode::kWeightGrad;
  g.plan = plan;
  g.m = m;
  g.n = n;
  g.a = a, g.a_rows = capacity, g.a_cols = m;
  g.b = b, g.b_rows = capacity, g.b_cols = n;
  g.out0 = out;
  g.out_f32 = grads.wgrad_f32;
  g.accumulate = grads.accumulate;
  g.errors = call.errors;
  return g;
}

GroupedGemmArgs::SideGather pool_side_gather(const void* rows, int64_t width, const DevicePlan& plan, const Carved& c) {
  GroupedGemmArgs::SideGather s;
  s.src = rows, s.width = width, s.row_src = plan.row_src, s.top_k = plan.top_k;
  s.pool_rows = plan.pool_rows, s.pool = c.xdy_pool;
  return s;
}

GroupedGemmArgs::SideGather pool_side_scatter(const void* rows, int64_t width, const DevicePlan& plan,
                                              const Carved& c) {
  GroupedGemmArgs::SideGather s = pool_side_gather(rows, width, plan, c);
  s.route_row = plan.route_row, s.tokens = plan.num_tokens;
  return s;
}

Status gather_own_a(GroupedGemmArgs& g, const void* rows, const Carved& c, cudaStream_t stream) {
  auto* counts = reinterpret_cast<uint32_t*>(c.dw_partial);
  const cudaError_t err = cudaMemsetAsync(counts, 0, static_cast<size_t>(c.capacity / 128) * 4, stream);
  if (err != cudaSuccess) return cuda_status("zero a side gather's row tile counts", err);
  g.side_gather = pool_side_gather(rows, g.a_cols, g.plan, c);
  g.side_gather.rows_ready = counts;
  g.rows_ready = counts, g.ready_value = 128;
  return Status::Ok();
}

Status launch_holding_own_rows(const GroupedGemmArgs& g, int sms, cudaStream_t stream, bool* launched) {
  const Status st = launch_grouped_gemm(g, sms, stream);
  *launched = st.ok();
  return st.code() == StatusCode::kUnavailable ? Status::Ok() : st;
}

Status down_grad_gemm(const LayerCall& call, const DevicePlan& plan, const Carved& c, const void* w2,
                      const float* topk_weights, float* d_topk, int sms, const void* dy_tokens) {
  const LayerDims& d = call.dims;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, C = c.capacity;
  GroupedGemmArgs gd = pool_gemm(GemmMode::kDownGrad, call, plan, C, c.xdy_pool, H, w2, E * H, I, I);
  if (dy_tokens != nullptr) gd.a = dy_tokens, gd.gather = GroupedGemmArgs::Gather::kA, gd.gather_tokens = d.tokens;
  gd.topk_weights = topk_weights;
  gd.z_pool = c.pv.z_pool;
  gd.out0 = c.dz_pool;
  gd.out1 = c.a_pool;
  gd.dw_partial = c.dw_partial;
  // 128 x 256 tiles only when kDownGrad gathers dy's rows and I >= 1536:
  // pooled, they are 13% (30B) and 3% (235B) slower than 128 x 128;
  // gathering, 12% faster at 235B and 12% at Mixtral, 10% slower at 30B (I
  // 768) since session 36's shorter producer loop (megamoe-gemm-bench,
  // perf-log sessions 35-36).
  gd.wide_down_grad = gd.gather == GroupedGemmArgs::Gather::kA && I >= 1536;
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(gd, sms, call.stream));
  return reduce_route_partials(c.dw_partial, static_cast<int>(I / kBlockN), c.pv.plan.route_row, d.tokens * d.top_k,
                               c.pv.plan.error_key, d_topk, call.stream);
}

GroupedGemmArgs gate_up_grad(const LayerCall& call, const DevicePlan& plan, const Carved& c, const void* w13,
                             const GroupedGemmArgs::PeerSlots* dx_peer_slots) {
  const LayerDims& d = call.dims;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, C = c.capacity;
  GroupedGemmArgs gx = pool_gemm(GemmMode::kGateUpGrad, call, plan, C, c.dz_pool, 2 * I, w13, E * 2 * I, H, H);
  gx.out0 = c.slots;
  if (dx_peer_slots != nullptr) gx.peer_slots = *dx_peer_slots;
  return gx;
}

Status data_grad_gemms(const LayerCall& call, const DevicePlan& plan, const Carved& c, const void* w2, const void* w13,
                       const float* topk_weights, float* d_topk, int sms,
                       const GroupedGemmArgs::PeerSlots* dx_peer_slots, const void* dy_tokens) {
  MEGAMOE_RETURN_IF_ERROR(down_grad_gemm(call, plan, c, w2, topk_weights, d_topk, sms, dy_tokens));
  return launch_grouped_gemm(gate_up_grad(call, plan, c, w13, dx_peer_slots), sms, call.stream);
}

}  // namespace megamoe::cuda::detail
