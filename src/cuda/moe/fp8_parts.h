// The FP8 steps of the one-GPU layer (cuda_layer.cu), DeepSeek-V3's recipe as
// the CPU reference emulates it (reference/numerics.h): e4m3 operands, 1 x 128
// row tiles along K for activations and output gradients, 128 x 128 blocks for
// weights, 128 x 1 (tokens x channel) tiles for the weight-gradient operands,
// fp32 accumulation promoted every 128 K (the engine, GroupedGemmArgs::fp8).
// x and dy are quantised as their token rows are scattered into the pool
// (scatter_quantize_e4m3_rows: each token row read once; x^T, dW13's
// operand, as x is gathered again in the backward);
// a and the other weight-gradient operands by separate passes over the pools
// (not yet fused into the epilogues that produce them); dz in kDownGrad's epilogue with
// power-of-two scales, by a pass with fp32 ones (fp8_parts.cpp says why).
// The e4m3 weights come from the caller's buffer
// (MoeBuffers::fp8_weights), filled by fill_fp8_weights when the caller says
// it is not current. Host code; async on the call's stream. The operand
// regions of GEMM1/2, the data gradients, dW2 and dW13 share one scratch area
// (core/layer_buffers.h, Fp8Layout): a step may write only its own set, and
// only after the previous set's last reader, in stream order (a quantize
// fused into an earlier step, or a step on another stream, must move its
// region out of the shared area first).
#pragma once

#include "cuda/moe/layer_parts.h"

namespace megamoe::cuda::detail {

bool fp8_forward(const LayerDims& d);   // fp8: the forward's GEMMs in FP8
bool fp8_backward(const LayerDims& d);  // fp8, fp8_bwd: the backward's

// The FP8 weight buffer: there, aligned and large enough.
Status check_fp8_weights(const LayerDims& dims, const LayerBuffers& buffers);

// The caller's FP8 weight buffer, checked, and quantised from w13 and w2
// unless the caller says it is current (MoeBuffers::fp8_weights_ready). A
// call that reads it needs it (`reads`: fp8's forward, every FP8 backward);
// fp8_bwd's forward reads none, but fills a buffer it is given for its backward.
Status refresh_fp8_weights(const LayerCall& call, const LayerBuffers& buffers, const Fp8Carved& f,
                           const LayerInputs& in, bool reads);

// w13 and w2 into f's weight regions: 128 x 128 blocks, as given (fp8 only) and
// transposed, one scale per block.
Status fill_fp8_weights(const LayerCall& call, const Fp8Carved& f, const void* w13, const void* w2);

// The forward's GEMMs (weights from f): x's rows scattered into the pool as
// e4m3 (scatter_quantize_e4m3_rows with plan.route_row: no bf16 x pool;
// x_quantized: f.x_q and
// f.x_s hold the pool's e4m3 rows already, as an expert-parallel owner
// gathers them from the e4m3 dispatch; x unused), kGateUp (z into
// z_pool when not null, a into the a pool), a quantised, kDown into the
// slots (or, with peer, into the source ranks' return slots). Also the
// backward's recomputation of z (z_pool, a_pool null). The pool passes
// cover its used rows only (plan.pool_rows, on the device).
Status fp8_gate_up(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f,
                   const void* x, const void* w13, void* z_pool, void* a_pool, int sms, bool x_quantized = false);

// The FP8 scale rule of the call's dims (fp8_scale).
Fp8Scale fp8_scale_of(const LayerDims& d);
Status fp8_down(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f, const void* w2,
                const float* topk_weights, int sms, const GroupedGemmArgs::PeerSlots* peer = nullptr);

// The backward's data-gradient GEMMs in FP8 (as data_grad_gemms), on the
// weights' transposed copies in f: dy's rows scattered into the pool as
// e4m3 (no bf16 dy pool: dW2's dy^T comes from dy's token rows,
// fp8_down_weight_grad; rows_in_pool: the bf16 pool holds them, as an
// expert-parallel owner gathers them, and is quantised; dy unused);
// dx_peer_slots as data_grad_gemms'.
Status fp8_data_grad_gemms(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f,
                           const void* dy, const void* w2, const void* w13, const float* topk_weights, float* d_topk,
                           int sms, const GroupedGemmArgs::PeerSlots* dx_peer_slots = nullptr,
                           bool rows_in_pool = false);

// dW[e] = A^T B over each expert's pool rows in FP8, from the bf16 pools a
// [C, m] and b [C, n], each quantised per 128 rows of each column first into
// (a_t, a_ts) and (b_t, b_ts); a (b) null: (a_t, a_ts) ((b_t, b_ts)) hold it
// quantised already.
Status fp8_weight_grad(const LayerCall& call, const DevicePlan& plan, int64_t capacity, const void* a, int64_t m,
                       uint8_t* a_t, float* a_ts, const void* b, int64_t n, uint8_t* b_t, float* b_ts, void* out,
                       const LayerGrads& grads, int sms);

// dW[e] = A^T B over each expert's pool rows (a [C, m], b [C, n]) in the
// backward's precision: fp8_weight_grad, or the bf16 kWeightGrad GEMM (the
// e4m3 regions unused).
Status weight_grad_gemm(const LayerCall& call, const DevicePlan& plan, int64_t capacity, const void* a, int64_t m,
                        uint8_t* a_t, float* a_ts, const void* b, int64_t n, uint8_t* b_t, float* b_ts, void* out,
                        const LayerGrads& grads, int sms);

// dW2[e] = dy^T (w a) in FP8 on one GPU: dy^T quantised per 128 pool rows of
// each column as dy's token rows are gathered (gather_quantize_e4m3_cols_t:
// no bf16 dy pool; the same bytes as the column pass over the gathered pool),
// (w a)^T from the a pool. dy: the layer's [tokens, H] output gradient.
Status fp8_down_weight_grad(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f,
                            const void* dy, const LayerGrads& grads, int sms);

// dW13[e] = dz^T x in FP8 (fp8_weight_grad on the dz pool): x^T quantised per
// 128 pool rows of each column as x's rows are gathered
// (gather_quantize_e4m3_cols_t: no bf16 x pool, one pass instead of two;
// the same bytes as gather_rows + the column pass, perf-log session 24).
Status fp8_gate_up_weight_grad(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f,
                               const void* x, const LayerGrads& grads, int sms);

}  // namespace megamoe::cuda::detail
