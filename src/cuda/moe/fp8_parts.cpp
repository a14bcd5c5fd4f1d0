#include "cuda/moe/fp8_parts.h"

#include <string>

#include "cuda/fp8/quantize.h"
#include "cuda/moe/layer_kernels.h"

namespace megamoe::cuda::detail {
namespace {

Fp8Scale scale_of(const LayerCall& call) { return fp8_scale_of(call.dims); }

// g's operands become e4m3: A (with its row scales) and B (with its block scales).
void use_fp8(GroupedGemmArgs& g, const uint8_t* a, const float* a_scales, const uint8_t* b, const float* b_scales) {
  g.fp8 = true;
  if (g.mode != GemmMode::kWeightGrad) g.rows_first = prefers_rows_first(g.plan, g.b_rows, g.b_cols, 1);  // e4m3
  g.a = a, g.a_scales = a_scales;
  g.b = b, g.b_scales = b_scales;
}

// A [tokens, H] operand's pool rows, quantised by columns into (q_t, s_t) as they are gathered.
Status gather_cols_t(const LayerCall& call, const DevicePlan& plan, const Carved& c, const void* rows, uint8_t* q_t,
                     float* s_t) {
  const LayerDims& d = call.dims;
  return gather_quantize_e4m3_cols_t(rows, d.hidden, plan.row_src, d.top_k, plan.pool_rows, c.capacity, scale_of(call),
                                     q_t, s_t, call.stream);
}

}  // namespace

Fp8Scale fp8_scale_of(const LayerDims& d) {
  return d.fp8_scale == ScaleMode::kPowerOfTwo ? Fp8Scale::kPowerOfTwo : Fp8Scale::kFloat32;
}

bool fp8_forward(const LayerDims& d) { return d.precision == Precision::kFP8; }
bool fp8_backward(const LayerDims& d) { return d.precision == Precision::kFP8 || d.precision == Precision::kFP8Bwd; }

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

Status refresh_fp8_weights(const LayerCall& call, const LayerBuffers& buffers, const Fp8Carved& f,
                           const LayerInputs& in, bool reads) {
  if (!fp8_backward(call.dims) || (!reads && buffers.fp8_weights == nullptr)) return Status::Ok();
  MEGAMOE_RETURN_IF_ERROR(check_fp8_weights(call.dims, buffers));
  if (buffers.fp8_weights_ready) return Status::Ok();
  return fill_fp8_weights(call, f, in.w13, in.w2);
}

Status fill_fp8_weights(const LayerCall& call, const Fp8Carved& f, const void* w13, const void* w2) {
  const LayerDims& d = call.dims;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts;
  const Fp8Scale sc = scale_of(call);
  MEGAMOE_RETURN_IF_ERROR(quantize_e4m3_blocks(w13, E, 2 * I, H, sc, f.w13_q, f.w13_t, f.w13_s, call.stream));
  return quantize_e4m3_blocks(w2, E, H, I, sc, f.w2_q, f.w2_t, f.w2_s, call.stream);
}

Status fp8_gate_up(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f,
                   const void* x, const void* w13, void* z_pool, void* a_pool, int sms, bool x_quantized) {
  const LayerDims& d = call.dims;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, C = c.capacity;
  const Fp8Scale sc = scale_of(call);
  // Each token row read once and written to its routes' pool rows.
  if (!x_quantized)
    MEGAMOE_RETURN_IF_ERROR(scatter_quantize_e4m3_rows(x, d.tokens, H, plan.route_row, d.top_k, plan.row_src,
                                                       plan.pool_rows, C, sc, f.x_q, f.x_s, nullptr, call.stream));
  GroupedGemmArgs g = pool_gemm(GemmMode::kGateUp, call, plan, C, c.xdy_pool, H, w13, E * 2 * I, H, I);
  use_fp8(g, f.x_q, f.x_s, f.w13_q, f.w13_s);
  g.out0 = z_pool, g.out1 = a_pool;
  return launch_grouped_gemm(g, sms, call.stream);
}

Status fp8_down(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f, const void* w2,
                const float* topk_weights, int sms, const GroupedGemmArgs::PeerSlots* peer) {
  const LayerDims& d = call.dims;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, C = c.capacity;
  const Fp8Scale sc = scale_of(call);
  MEGAMOE_RETURN_IF_ERROR(
      quantize_e4m3_rows(c.a_pool, C, I, sc, f.a_q, f.a_s, call.stream, RowScales::kByRow, plan.pool_rows));
  GroupedGemmArgs g = pool_gemm(GemmMode::kDown, call, plan, C, c.a_pool, I, w2, E * H, I, H);
  use_fp8(g, f.a_q, f.a_s, f.w2_q, f.w2_s);
  g.topk_weights = topk_weights;
  g.out0 = c.slots;
  if (peer != nullptr) g.peer_slots = *peer;
  return launch_grouped_gemm(g, sms, call.stream);
}

Status fp8_data_grad_gemms(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f,
                           const void* dy, const void* w2, const void* w13, const float* topk_weights, float* d_topk,
                           int sms, const GroupedGemmArgs::PeerSlots* dx_peer_slots, bool rows_in_pool) {
  const LayerDims& d = call.dims;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, C = c.capacity;
  const Fp8Scale sc = scale_of(call);
  // ga = dy @ w2[e]: K = H; B = w2[e]^T as [E * I, H].
  // dy's e4m3 rows: scattered into the pool from its token rows (dW2's dy^T
  // comes from them too, fp8_down_weight_grad: no bf16 dy pool), or quantised
  // from the pool an expert-parallel owner received.
  if (rows_in_pool)
    MEGAMOE_RETURN_IF_ERROR(quantize_e4m3_rows(c.xdy_pool, C, H, sc, f.dy_q, f.dy_s, call.stream, RowScales::kByRow,
                                               plan.pool_rows));
  else
    MEGAMOE_RETURN_IF_ERROR(scatter_quantize_e4m3_rows(dy, d.tokens, H, plan.route_row, d.top_k, plan.row_src,
                                                       plan.pool_rows, C, sc, f.dy_q, f.dy_s, nullptr, call.stream));
  GroupedGemmArgs gd = pool_gemm(GemmMode::kDownGrad, call, plan, C, c.xdy_pool, H, w2, E * I, H, I);
  use_fp8(gd, f.dy_q, f.dy_s, f.w2_t, f.w2_s);
  gd.b_k_major = true;
  gd.topk_weights = topk_weights;
  gd.z_pool = c.pv.z_pool;
  gd.out0 = c.dz_pool, gd.out1 = c.a_pool, gd.dw_partial = c.dw_partial;
  // dz's e4m3 rows: with power-of-two scales from the epilogue that writes dz
  // (a multiply per value; at 16384 tokens kDownGrad grows 192 / 478 us at
  // 30B / 235B, the separate pass it replaces took 315 / 617 us); with fp32
  // scales by a pass over the dz pool, as the epilogue's division made
  // kDownGrad 330 / 600 us slower than the pass (perf-log, session 23).
  const bool dz_in_epilogue = sc == Fp8Scale::kPowerOfTwo;
  if (dz_in_epilogue) gd.dz_q = f.dz_q, gd.dz_s = f.dz_s, gd.dz_scale = sc;
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(gd, sms, call.stream));
  MEGAMOE_RETURN_IF_ERROR(reduce_route_partials(c.dw_partial, static_cast<int>(I / kBlockN), c.pv.plan.route_row,
                                                d.tokens * d.top_k, c.pv.plan.error_key, d_topk, call.stream));
  // dx slots = dz @ w13[e]: K = 2I; B = w13[e]^T as [E * H, 2I].
  if (!dz_in_epilogue)
    MEGAMOE_RETURN_IF_ERROR(quantize_e4m3_rows(c.dz_pool, C, 2 * I, sc, f.dz_q, f.dz_s, call.stream, RowScales::kByRow,
                                               plan.pool_rows));
  GroupedGemmArgs gx = pool_gemm(GemmMode::kGateUpGrad, call, plan, C, c.dz_pool, 2 * I, w13, E * H, 2 * I, H);
  use_fp8(gx, f.dz_q, f.dz_s, f.w13_t, f.w13_s);
  gx.b_k_major = true;
  gx.out0 = c.slots;
  if (dx_peer_slots != nullptr) gx.peer_slots = *dx_peer_slots;
  return launch_grouped_gemm(gx, sms, call.stream);
}

Status fp8_weight_grad(const LayerCall& call, const DevicePlan& plan, int64_t capacity, const void* a, int64_t m,
                       uint8_t* a_t, float* a_ts, const void* b, int64_t n, uint8_t* b_t, float* b_ts, void* out,
                       const LayerGrads& grads, int sms) {
  const Fp8Scale sc = scale_of(call);
  if (a != nullptr)
    MEGAMOE_RETURN_IF_ERROR(quantize_e4m3_cols_t(a, capacity, m, sc, a_t, a_ts, call.stream, plan.pool_rows));
  if (b != nullptr)
    MEGAMOE_RETURN_IF_ERROR(quantize_e4m3_cols_t(b, capacity, n, sc, b_t, b_ts, call.stream, plan.pool_rows));
  GroupedGemmArgs g = weight_grad(call, plan, capacity, a, m, b, n, out, grads);
  use_fp8(g, a_t, a_ts, b_t, b_ts);
  g.a_rows = m, g.a_cols = capacity;
  g.b_rows = n, g.b_cols = capacity;
  return launch_grouped_gemm(g, sms, call.stream);
}

Status weight_grad_gemm(const LayerCall& call, const DevicePlan& plan, int64_t capacity, const void* a, int64_t m,
                        uint8_t* a_t, float* a_ts, const void* b, int64_t n, uint8_t* b_t, float* b_ts, void* out,
                        const LayerGrads& grads, int sms) {
  if (fp8_backward(call.dims))
    return fp8_weight_grad(call, plan, capacity, a, m, a_t, a_ts, b, n, b_t, b_ts, out, grads, sms);
  return launch_grouped_gemm(weight_grad(call, plan, capacity, a, m, b, n, out, grads), sms, call.stream);
}

Status fp8_down_weight_grad(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f,
                            const void* dy, const LayerGrads& grads, int sms) {
  const LayerDims& d = call.dims;
  MEGAMOE_RETURN_IF_ERROR(gather_cols_t(call, plan, c, dy, f.dy_t, f.dy_ts));
  return fp8_weight_grad(call, plan, c.capacity, nullptr, d.hidden, f.dy_t, f.dy_ts, c.a_pool, d.intermediate, f.wa_t,
                         f.wa_ts, grads.dw2, grads, sms);
}

Status fp8_gate_up_weight_grad(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f,
                               const void* x, const LayerGrads& grads, int sms) {
  const LayerDims& d = call.dims;
  MEGAMOE_RETURN_IF_ERROR(gather_cols_t(call, plan, c, x, f.x_t, f.x_ts));
  return fp8_weight_grad(call, plan, c.capacity, c.dz_pool, 2 * d.intermediate, f.dz_t, f.dz_ts, nullptr, d.hidden,
                         f.x_t, f.x_ts, grads.dw13, grads, sms);
}

}  // namespace megamoe::cuda::detail
