// The steps of the MoE layer, one set for the one-GPU layer and the
// expert-parallel owners, forward and backward: gate/up (GEMM1 + SwiGLU),
// down (GEMM2 x routing weight), the data gradients (kDownGrad with the d
// topk_w reduction, then kGateUpGrad) and the weight gradients (dW2, dW13).
// Each runs in the call's precision (bf16, or FP8 with its quantisers
// before the GEMM) and takes its token rows where they are (TokenRows).
// Host code; async on the call's stream, no synchronisation.
//
// FP8: the operand sets of GEMM1/2, the data gradients, dW2 and dW13 share
// one scratch area (core/layer_buffers.h, Fp8Layout): a step may write only
// its own set, and only after the previous set's last reader, in stream
// order; run the steps in the order a composite below runs them.
#pragma once

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/layer/call_buffers.h"
#include "cuda/layer/layer_call.h"

namespace megamoe::cuda {

// What every step of one call works with.
struct LayerStep {
  const LayerCall& call;
  const CallBuffers& buf;
  int sms;
};

// Where a step's token rows (x, or dy) are.
struct TokenRows {
  // bf16 [T, width]: the call's token rows (one GPU), or an expert-parallel
  // owner's virtual token matrix (its receive area); null with in_pool.
  const void* tokens = nullptr;
  bool in_pool = false;    // the hidden pool holds them (bf16) already
  bool quantized = false;  // fp8.x_q / x_s hold them as e4m3 rows (an owner's e4m3 dispatch)
};

// GEMM1 + SwiGLU in the forward's precision: z into z (when not null), a into
// the a pool (when not null: the backward's recomputation passes none). bf16
// token rows not yet pooled: the GEMM gathers them itself in its idle
// producer warps (CudaPaths::side_jobs; where the SMs are partitioned and its
// cooperative launch is refused, a kernel pools them first); FP8: they are
// quantised as they are scattered into the pool (no bf16 x pool).
Status gate_up(const LayerStep& s, const TokenRows& x, const void* w13, void* z, void* a);

// GEMM2 x routing weight (down_gemm's destinations); FP8 quantises a first.
Status down(const LayerStep& s, const void* w2, const float* topk_weights, const PeerSlots* peer = nullptr);

// kDownGrad on dy's rows (pooled first, bf16; quantised as they are
// scattered into the pool, FP8) with its fused epilogue, then the d topk_w
// reduction into d_topk [T * k]. Marks bf16 rows pooled.
Status down_grad(const LayerStep& s, TokenRows& dy, const void* w2, const float* topk_weights, float* d_topk);

// kGateUpGrad: dx rows into the local slots or the source ranks' (peer). With
// x_for_pool (bf16 with side jobs) its idle producer warps scatter x into the
// hidden pool meanwhile, and x_for_pool is marked pooled.
Status gate_up_grad(const LayerStep& s, const void* w13, const PeerSlots* peer, TokenRows* x_for_pool);

// dW2 from dy's rows (the pool's, bf16; FP8: dy^T quantised per 128 pool
// rows of each column, from the token rows as they are gathered or from the
// pool) and the a pool (w a).
Status down_weight_grad(const LayerStep& s, TokenRows& dy, const LayerGrads& grads);

// dW13 from the dz pool and x's rows (pooled first where they are not,
// bf16; FP8 as dW2). combine_dx (bf16): dx's slot sum rides in its side jobs.
Status gate_up_weight_grad(const LayerStep& s, TokenRows& x, const LayerGrads& grads,
                           const SideCombine* combine_dx = nullptr);

}  // namespace megamoe::cuda
