// The layer's six GEMMs as arguments of the engine (cuda/gemm/grouped_gemm.h),
// each built in one place for every caller: the layer's steps
// (layer_steps.h), the kernel-selection test (tests/cpu/kernel_config_test)
// and megamoe-gemm-bench. Each builds the GEMM in the call's precision (bf16,
// or e4m3 on the call's quantised operands and weights) with the side jobs
// it is given. Pure host code: no launch here.
#pragma once

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/layer/call_buffers.h"
#include "cuda/layer/layer_call.h"

namespace megamoe::cuda {

// GEMM1 + SwiGLU: z (when not null) and a (when not null) from the pool's x
// rows and w13 [E, 2I, H]. bf16: A is the hidden pool; with gather_from, the
// kernel's idle producer warps gather it from those token rows themselves,
// counting each row into dw_partial's row-tile counts, and every tile waits
// for its 128 rows (a cooperative launch). FP8: A is fp8.x_q / x_s.
GroupedGemmArgs gate_up_gemm(const LayerCall& call, const CallBuffers& b, const void* w13, void* z, void* a,
                             const void* gather_from = nullptr);

// GEMM2 x routing weight: each route's row into the local slots, the source
// ranks' return slots (peer), or, bf16 with CudaPaths::down_to_pool, into
// the hidden pool in pool order (down_writes_pool_rows). FP8: A is fp8.a_q.
GroupedGemmArgs down_gemm(const LayerCall& call, const CallBuffers& b, const void* w2, const float* topk_weights,
                          const PeerSlots* peer = nullptr);
bool down_writes_pool_rows(const LayerCall& call, const CallBuffers& b, const PeerSlots* peer);

// ga = dy @ w2[e] with the fused SwiGLU backward: d topk_w partials, dz into
// the dz pool, w a into the a pool. bf16: dy from the hidden pool; FP8: from
// fp8.dy_q, B the transposed e4m3 w2, and with power-of-two scales dz's e4m3
// rows from the epilogue (dz_in_epilogue).
GroupedGemmArgs down_grad_gemm(const LayerCall& call, const CallBuffers& b, const void* w2, const float* topk_weights);
bool dz_in_epilogue(const LayerCall& call);

// dx rows = dz @ w13[e] into the local slots, or the source ranks' (peer).
// bf16 with scatter_x: the idle producer warps scatter those token rows into
// the hidden pool meanwhile (x for dW13; the pool's dy is dead by then).
GroupedGemmArgs gate_up_grad_gemm(const LayerCall& call, const CallBuffers& b, const void* w13,
                                  const PeerSlots* peer = nullptr, const void* scatter_x = nullptr);

// dW2[e] = dy^T (w a) over each expert's rows: bf16 from the hidden pool
// (dy) and the a pool; FP8 from fp8.dy_t and fp8.wa_t.
GroupedGemmArgs down_weight_grad_gemm(const LayerCall& call, const CallBuffers& b, const LayerGrads& grads);

// dW13[e] = dz^T x: bf16 from the dz pool and the hidden pool (x); FP8 from
// fp8.dz_t and fp8.x_t. bf16 with combine_dx: the idle producer warps sum dx
// from the slots meanwhile (dx_side_combine).
GroupedGemmArgs gate_up_weight_grad_gemm(const LayerCall& call, const CallBuffers& b, const LayerGrads& grads,
                                         const SideCombine* combine_dx = nullptr);
SideCombine dx_side_combine(const LayerCall& call, const CallBuffers& b, const int32_t* topk_idx, void* dx);

// Whether the bf16 layer's memory-bound steps ride in its GEMMs (CudaPaths::side_jobs).
bool forward_side_jobs(const LayerCall& call);
bool backward_side_jobs(const LayerCall& call);

}  // namespace megamoe::cuda
