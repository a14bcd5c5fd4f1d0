#include "cuda/layer/layer_steps.h"

#include "cuda/common/cuda_status.h"
#include "cuda/fp8/quantize.h"
#include "cuda/layer/layer_gemms.h"
#include "cuda/layer/layer_kernels.h"

namespace megamoe::cuda {
namespace {

Status launch(const LayerStep& s, const GroupedGemmArgs& g) { return launch_grouped_gemm(g, s.sms, s.call.stream); }

// Token rows [T, width] into the hidden pool, each read once (scatter_rows:
// the pool gather_rows would make, with less DRAM traffic).
Status pool_rows(const LayerStep& s, TokenRows& rows, int64_t width) {
  const LayerDims& d = s.call.dims;
  const DevicePlan& p = s.buf.gemm_plan;
  MEGAMOE_RETURN_IF_ERROR(scatter_rows(rows.tokens, d.tokens, width, p.route_row, d.top_k, p.row_src, p.pool_rows,
                                       s.buf.capacity, s.buf.hidden_pool, s.call.stream));
  rows.in_pool = true;
  return Status::Ok();
}

// e4m3 row tiles (1 x 128 along K) of a pool's used rows.
Status quantize_pool_rows(const LayerStep& s, const void* pool, int64_t cols, uint8_t* q, float* scales) {
  return quantize_e4m3_rows(pool, s.buf.capacity, cols, fp8_scale_of(s.call.dims), q, scales, s.call.stream,
                            RowScales::kByRow, s.buf.gemm_plan.pool_rows);
}
// e4m3 row tiles of token rows, as they are scattered into their pool rows.
Status quantize_token_rows(const LayerStep& s, const void* tokens, uint8_t* q, float* scales) {
  const LayerDims& d = s.call.dims;
  const DevicePlan& p = s.buf.gemm_plan;
  return scatter_quantize_e4m3_rows(tokens, d.tokens, d.hidden, p.route_row, d.top_k, p.row_src, p.pool_rows,
                                    s.buf.capacity, fp8_scale_of(d), q, scales, nullptr, s.call.stream);
}
// Columns quantised per 128 pool rows, transposed (the weight gradients' operands): of a pool, or of
// token rows as they are gathered (the same bytes as the column pass over the gathered pool).
Status quantize_pool_cols(const LayerStep& s, const void* pool, int64_t cols, uint8_t* q_t, float* scales) {
  return quantize_e4m3_cols_t(pool, s.buf.capacity, cols, fp8_scale_of(s.call.dims), q_t, scales, s.call.stream,
                              s.buf.gemm_plan.pool_rows);
}
Status quantize_rows_cols(const LayerStep& s, const TokenRows& rows, uint8_t* q_t, float* scales) {
  if (rows.in_pool) return quantize_pool_cols(s, s.buf.hidden_pool, s.call.dims.hidden, q_t, scales);
  const LayerDims& d = s.call.dims;
  const DevicePlan& p = s.buf.gemm_plan;
  return gather_quantize_e4m3_cols_t(rows.tokens, d.hidden, p.row_src, d.top_k, p.pool_rows, s.buf.capacity,
                                     fp8_scale_of(d), q_t, scales, s.call.stream);
}

// g gathering its own A (side jobs), its tiles held on the gather's row
// counts: every CTA must be resident at once, a cooperative launch. Where
// the SMs are partitioned (MPS) that launch is refused: *launched is then
// false, nothing ran.
Status launch_holding_own_rows(const LayerStep& s, const GroupedGemmArgs& g, bool* launched) {
  const cudaError_t err = cudaMemsetAsync(g.side_gather.rows_ready, 0,
                                          static_cast<size_t>(s.buf.capacity / 128) * sizeof(uint32_t), s.call.stream);
  if (err != cudaSuccess) return cuda_status("zero a side gather's row tile counts", err);
  const Status st = launch(s, g);
  *launched = st.ok();
  return st.code() == StatusCode::kUnavailable ? Status::Ok() : st;
}

}  // namespace

Status gate_up(const LayerStep& s, const TokenRows& x, const void* w13, void* z, void* a) {
  const LayerCall& call = s.call;
  if (fp8_forward(call.dims)) {
    if (!x.quantized) MEGAMOE_RETURN_IF_ERROR(quantize_token_rows(s, x.tokens, s.buf.fp8.x_q, s.buf.fp8.x_s));
    return launch(s, gate_up_gemm(call, s.buf, w13, z, a));
  }
  TokenRows rows = x;
  if (!rows.in_pool && forward_side_jobs(call)) {
    bool launched = false;
    MEGAMOE_RETURN_IF_ERROR(launch_holding_own_rows(s, gate_up_gemm(call, s.buf, w13, z, a, rows.tokens), &launched));
    if (launched) return Status::Ok();
  }
  if (!rows.in_pool) MEGAMOE_RETURN_IF_ERROR(pool_rows(s, rows, call.dims.hidden));
  return launch(s, gate_up_gemm(call, s.buf, w13, z, a));
}

Status down(const LayerStep& s, const void* w2, const float* topk_weights, const PeerSlots* peer) {
  if (fp8_forward(s.call.dims))
    MEGAMOE_RETURN_IF_ERROR(
        quantize_pool_rows(s, s.buf.a_pool, s.call.dims.intermediate, s.buf.fp8.a_q, s.buf.fp8.a_s));
  return launch(s, down_gemm(s.call, s.buf, w2, topk_weights, peer));
}

Status down_grad(const LayerStep& s, TokenRows& dy, const void* w2, const float* topk_weights, float* d_topk) {
  const LayerDims& d = s.call.dims;
  if (!fp8_backward(d)) {
    if (!dy.in_pool) MEGAMOE_RETURN_IF_ERROR(pool_rows(s, dy, d.hidden));
  } else if (dy.in_pool) {
    MEGAMOE_RETURN_IF_ERROR(quantize_pool_rows(s, s.buf.hidden_pool, d.hidden, s.buf.fp8.dy_q, s.buf.fp8.dy_s));
  } else {
    MEGAMOE_RETURN_IF_ERROR(quantize_token_rows(s, dy.tokens, s.buf.fp8.dy_q, s.buf.fp8.dy_s));
  }
  MEGAMOE_RETURN_IF_ERROR(launch(s, down_grad_gemm(s.call, s.buf, w2, topk_weights)));
  return reduce_route_partials(s.buf.dw_partial, static_cast<int>(d.intermediate / kBlockN), s.buf.plan.route_row,
                               d.tokens * d.top_k, s.buf.plan.error_key, d_topk, s.call.stream);
}

Status gate_up_grad(const LayerStep& s, const void* w13, const PeerSlots* peer, TokenRows* x_for_pool) {
  const LayerDims& d = s.call.dims;
  if (fp8_backward(d) && !dz_in_epilogue(s.call))
    MEGAMOE_RETURN_IF_ERROR(quantize_pool_rows(s, s.buf.dz_pool, 2 * d.intermediate, s.buf.fp8.dz_q, s.buf.fp8.dz_s));
  const bool scatter = x_for_pool != nullptr && !x_for_pool->in_pool && backward_side_jobs(s.call);
  MEGAMOE_RETURN_IF_ERROR(
      launch(s, gate_up_grad_gemm(s.call, s.buf, w13, peer, scatter ? x_for_pool->tokens : nullptr)));
  if (scatter) x_for_pool->in_pool = true;
  return Status::Ok();
}

Status down_weight_grad(const LayerStep& s, TokenRows& dy, const LayerGrads& grads) {
  const LayerDims& d = s.call.dims;
  if (fp8_backward(d)) {
    MEGAMOE_RETURN_IF_ERROR(quantize_rows_cols(s, dy, s.buf.fp8.dy_t, s.buf.fp8.dy_ts));
    MEGAMOE_RETURN_IF_ERROR(quantize_pool_cols(s, s.buf.a_pool, d.intermediate, s.buf.fp8.wa_t, s.buf.fp8.wa_ts));
  } else if (!dy.in_pool) {
    MEGAMOE_RETURN_IF_ERROR(pool_rows(s, dy, d.hidden));
  }
  return launch(s, down_weight_grad_gemm(s.call, s.buf, grads));
}

Status gate_up_weight_grad(const LayerStep& s, TokenRows& x, const LayerGrads& grads, const SideCombine* combine_dx) {
  const LayerDims& d = s.call.dims;
  if (fp8_backward(d)) {
    MEGAMOE_RETURN_IF_ERROR(quantize_rows_cols(s, x, s.buf.fp8.x_t, s.buf.fp8.x_ts));
    MEGAMOE_RETURN_IF_ERROR(
        quantize_pool_cols(s, s.buf.dz_pool, 2 * d.intermediate, s.buf.fp8.dz_t, s.buf.fp8.dz_ts));
  } else if (!x.in_pool) {
    MEGAMOE_RETURN_IF_ERROR(pool_rows(s, x, d.hidden));
  }
  return launch(s, gate_up_weight_grad_gemm(s.call, s.buf, grads, combine_dx));
}

}  // namespace megamoe::cuda
