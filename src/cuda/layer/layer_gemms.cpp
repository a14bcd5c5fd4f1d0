#include "cuda/layer/layer_gemms.h"

namespace megamoe::cuda {
namespace {

// Experts whose weights (B) pass this many bytes walk their tiles rows first:
// concurrently running tiles then read a few column tiles of B instead of all
// of it (Mixtral's w13: 235 MB an expert, against the H200's 50 MB of L2).
// megamoe-gemm-bench: Mixtral's kGateUp -27%, kDownGrad -13%; Qwen3-235B-A22B
// (w13 25 MB, w2 13 MB) -1..-2% in all four modes; Qwen3-30B-A3B (w13 6 MB)
// +8..+14%, so it stays below.
constexpr int64_t kRowsFirstWeightBytes = int64_t{10} << 20;

TileOrder tile_order(const LayerCall& call, const GroupedGemmArgs& g, int elem_bytes) {
  const int E = g.plan.num_experts;
  const bool large = E > 0 && g.b.rows / E * g.b.cols * elem_bytes > kRowsFirstWeightBytes;
  return call.paths.rows_first && large ? TileOrder::kRowsFirst : TileOrder::kColumnsFirst;
}

// An M-grouped GEMM over the pool: A = pool rows [C, k], B = stacked expert weights [b_rows, b_cols].
GroupedGemmArgs pool_gemm(GemmMode mode, const LayerCall& call, const CallBuffers& c, const void* a, int64_t k,
                          const void* b, int64_t b_rows, int64_t b_cols, int64_t n) {
  GroupedGemmArgs g;
  g.mode = mode;
  g.plan = c.gemm_plan;
  g.n = n;
  g.k = k;
  g.intermediate = call.dims.intermediate;
  g.a = {a, c.capacity, k, nullptr};
  g.b = {b, b_rows, b_cols, nullptr};
  g.tile_order = tile_order(call, g, 2);
  g.errors = call.errors;
  return g;
}

// g's operands become e4m3: A with its row scales, B with its block scales (the tile order decided again).
void use_fp8(const LayerCall& call, GroupedGemmArgs& g, const uint8_t* a, const float* a_scales, const uint8_t* b,
             const float* b_scales) {
  g.elem = ElemType::kE4M3;
  if (g.mode != GemmMode::kWeightGrad) g.tile_order = tile_order(call, g, 1);
  g.a.data = a, g.a.scales = a_scales;
  g.b.data = b, g.b.scales = b_scales;
}

// dW[e] = A_pool^T @ B_pool over each expert's rows (K-grouped): A [C, m], B [C, n].
GroupedGemmArgs weight_grad(const LayerCall& call, const CallBuffers& c, const void* a, int64_t m, const void* b,
                            int64_t n, void* out, const LayerGrads& grads) {
  GroupedGemmArgs g;
  g.mode = GemmMode::kWeightGrad;
  g.plan = c.gemm_plan;
  g.m = m;
  g.n = n;
  g.a = {a, c.capacity, m, nullptr};
  g.b = {b, c.capacity, n, nullptr};
  g.out.dw = out;
  g.out.dw_f32 = grads.wgrad_f32;
  g.out.accumulate = grads.accumulate;
  g.errors = call.errors;
  return g;
}

// FP8 kWeightGrad reads both operands transposed: A^T [m, C], B^T [n, C].
void use_fp8_transposed(GroupedGemmArgs& g, const uint8_t* a_t, const float* a_ts, const uint8_t* b_t,
                        const float* b_ts) {
  g.elem = ElemType::kE4M3;
  g.a = {a_t, g.m, g.a.rows, a_ts};
  g.b = {b_t, g.n, g.b.rows, b_ts};
}

}  // namespace

bool forward_side_jobs(const LayerCall& call) { return call.paths.side_jobs && !fp8_forward(call.dims); }
bool backward_side_jobs(const LayerCall& call) { return call.paths.side_jobs && !fp8_backward(call.dims); }
bool dz_in_epilogue(const LayerCall& call) { return fp8_scale_of(call.dims) == Fp8Scale::kPowerOfTwo; }

GroupedGemmArgs gate_up_gemm(const LayerCall& call, const CallBuffers& c, const void* w13, void* z, void* a,
                             const void* gather_from) {
  const LayerDims& d = call.dims;
  GroupedGemmArgs g = pool_gemm(GemmMode::kGateUp, call, c, c.hidden_pool, d.hidden, w13,
                                d.num_experts * 2 * d.intermediate, d.hidden, d.intermediate);
  if (fp8_forward(d)) use_fp8(call, g, c.fp8.x_q, c.fp8.x_s, c.fp8_weights.w13_q, c.fp8_weights.w13_s);
  g.out.z = z, g.out.a = a;
  if (gather_from != nullptr) {  // its own A from the token rows, each tile held until its 128 rows are in
    auto* counts = reinterpret_cast<uint32_t*>(c.dw_partial);
    SideGather& s = g.side_gather;
    s.src = gather_from, s.width = g.a.cols, s.row_src = g.plan.row_src, s.top_k = g.plan.top_k;
    s.pool_rows = g.plan.pool_rows, s.pool = c.hidden_pool;
    s.rows_ready = counts;
    g.arrival.rows_ready = counts, g.arrival.ready_value = 128;
  }
  return g;
}

bool down_writes_pool_rows(const LayerCall& call, const CallBuffers& c, const PeerSlots* peer) {
  return call.paths.down_to_pool && !fp8_forward(call.dims) && call.dims.hidden % 256 == 0 &&
         c.hidden_pool != nullptr && peer == nullptr;
}

GroupedGemmArgs down_gemm(const LayerCall& call, const CallBuffers& c, const void* w2, const float* topk_weights,
                          const PeerSlots* peer) {
  const LayerDims& d = call.dims;
  GroupedGemmArgs g = pool_gemm(GemmMode::kDown, call, c, c.a_pool, d.intermediate, w2, d.num_experts * d.hidden,
                                d.intermediate, d.hidden);
  if (fp8_forward(d)) use_fp8(call, g, c.fp8.a_q, c.fp8.a_s, c.fp8_weights.w2_q, c.fp8_weights.w2_s);
  g.out.topk_weights = topk_weights;
  if (peer != nullptr) {
    g.out.peer_slots = *peer;
  } else if (down_writes_pool_rows(call, c, peer)) {
    g.out.pool_rows = c.hidden_pool;
  } else {
    g.out.slots = c.slots;
  }
  return g;
}

GroupedGemmArgs down_grad_gemm(const LayerCall& call, const CallBuffers& c, const void* w2,
                               const float* topk_weights) {
  const LayerDims& d = call.dims;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts;
  const bool fp8 = fp8_backward(d);
  // B: w2 as [E * H, I] (bf16, MN-major), or its transposed e4m3 copy [E * I, H].
  GroupedGemmArgs g = fp8 ? pool_gemm(GemmMode::kDownGrad, call, c, c.hidden_pool, H, w2, E * I, H, I)
                          : pool_gemm(GemmMode::kDownGrad, call, c, c.hidden_pool, H, w2, E * H, I, I);
  if (fp8) {
    use_fp8(call, g, c.fp8.dy_q, c.fp8.dy_s, c.fp8_weights.w2_t, c.fp8_weights.w2_s);
    g.b_transposed = true;
  }
  g.out.topk_weights = topk_weights;
  g.out.z_in = c.z_pool;
  g.out.dz = c.dz_pool, g.out.wa = c.a_pool, g.out.dw_partial = c.dw_partial;
  // dz's e4m3 rows: with power-of-two scales from the epilogue that writes dz
  // (a multiply per value; at 16384 tokens kDownGrad grows 192 / 478 us at
  // 30B / 235B, the separate pass it replaces took 315 / 617 us); with fp32
  // scales by a pass over the dz pool, as the epilogue's division made
  // kDownGrad 330 / 600 us slower than the pass.
  if (fp8 && dz_in_epilogue(call))
    g.out.dz_q = c.fp8.dz_q, g.out.dz_s = c.fp8.dz_s, g.out.dz_scale = fp8_scale_of(d);
  return g;
}

GroupedGemmArgs gate_up_grad_gemm(const LayerCall& call, const CallBuffers& c, const void* w13, const PeerSlots* peer,
                                  const void* scatter_x) {
  const LayerDims& d = call.dims;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts;
  const bool fp8 = fp8_backward(d);
  // B: w13 as [E * 2I, H] (bf16, MN-major), or its transposed e4m3 copy [E * H, 2I].
  GroupedGemmArgs g = fp8 ? pool_gemm(GemmMode::kGateUpGrad, call, c, c.dz_pool, 2 * I, w13, E * H, 2 * I, H)
                          : pool_gemm(GemmMode::kGateUpGrad, call, c, c.dz_pool, 2 * I, w13, E * 2 * I, H, H);
  if (fp8) {
    use_fp8(call, g, c.fp8.dz_q, c.fp8.dz_s, c.fp8_weights.w13_t, c.fp8_weights.w13_s);
    g.b_transposed = true;
  }
  if (peer != nullptr) {
    g.out.peer_slots = *peer;
  } else {
    g.out.slots = c.slots;
  }
  if (scatter_x != nullptr) {  // each token row read once, stored to its routes' pool rows
    SideGather& s = g.side_gather;
    s.src = scatter_x, s.width = H, s.row_src = g.plan.row_src, s.top_k = g.plan.top_k;
    s.pool_rows = g.plan.pool_rows, s.pool = c.hidden_pool;
    s.route_row = g.plan.route_row, s.tokens = g.plan.num_tokens;
  }
  return g;
}

GroupedGemmArgs down_weight_grad_gemm(const LayerCall& call, const CallBuffers& c, const LayerGrads& grads) {
  const LayerDims& d = call.dims;
  GroupedGemmArgs g = weight_grad(call, c, c.hidden_pool, d.hidden, c.a_pool, d.intermediate, grads.dw2, grads);
  if (fp8_backward(d)) use_fp8_transposed(g, c.fp8.dy_t, c.fp8.dy_ts, c.fp8.wa_t, c.fp8.wa_ts);
  return g;
}

GroupedGemmArgs gate_up_weight_grad_gemm(const LayerCall& call, const CallBuffers& c, const LayerGrads& grads,
                                         const SideCombine* combine_dx) {
  const LayerDims& d = call.dims;
  GroupedGemmArgs g =
      weight_grad(call, c, c.dz_pool, 2 * d.intermediate, c.hidden_pool, d.hidden, grads.dw13, grads);
  if (fp8_backward(d)) use_fp8_transposed(g, c.fp8.dz_t, c.fp8.dz_ts, c.fp8.x_t, c.fp8.x_ts);
  if (combine_dx != nullptr) g.side_combine = *combine_dx;
  return g;
}

SideCombine dx_side_combine(const LayerCall& call, const CallBuffers& c, const int32_t* topk_idx, void* dx) {
  const LayerDims& d = call.dims;
  SideCombine s;
  s.slots = c.slots, s.slot_tokens = d.tokens;
  s.topk_idx = topk_idx, s.tokens = d.tokens, s.begin = 0, s.end = d.tokens;
  s.top_k = d.top_k, s.num_experts = d.num_experts, s.hidden = d.hidden;
  s.error_key = c.plan.error_key;
  s.out = dx;
  return s;
}

}  // namespace megamoe::cuda
