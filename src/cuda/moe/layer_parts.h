// Pieces of the layer's launch code that the one-GPU layer (cuda_layer.cu)
// and the expert-parallel one (ep_layer.cu) share: where each buffer sits in
// scratch and saved memory, and how a pool GEMM is set up. Host code.
#pragma once

#include <cstdint>

#include "core/layer_buffers.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/moe/cuda_layer.h"
#include "cuda/moe/device_plan.h"

namespace megamoe::cuda::detail {

// The plan region (saved layout) of a call: in the saved buffer, or in scratch.
struct PlanView {
  DevicePlanBuffers plan;
  void* z_pool;
};

struct Carved {
  PlanView pv;
  void *xdy_pool, *a_pool, *slots, *dz_pool;
  float* dw_partial;
  int64_t capacity;
};

// The call's buffers (core/layer_buffers.h) as pointers.
Status carve(const LayerCall& call, const LayerBuffers& b, Carved* c);

// The FP8 operands of a call (ScratchLayout::fp8) and its e4m3 weights
// (MoeBuffers::fp8_weights, Fp8WeightLayout) as pointers; null where the
// call's precision has no such region.
struct Fp8Carved {
  uint8_t *x_q, *a_q, *w13_q, *w2_q, *w13_t, *w2_t, *dy_q, *dz_q, *dy_t, *wa_t, *dz_t, *x_t;
  float *x_s, *a_s, *w13_s, *w2_s, *dy_s, *dz_s, *dy_ts, *wa_ts, *dz_ts, *x_ts;
};
Status carve_fp8(const LayerCall& call, const LayerBuffers& b, Fp8Carved* f);
// The weight fields of *f alone, from an FP8 weight buffer (null: left null).
Status carve_fp8_weights(const LayerDims& dims, void* buffer, Fp8Carved* f);

int sm_count(int device);

// The bf16 layers' memory-bound steps as side jobs of their GEMMs (the idle
// producer warps), -DMEGAMOE_SIDE_JOBS (on by default): cuda_layer.cu says
// which; the EP forward's kGateUp gathers its pool so too (ep_layer.cu).
#ifdef MEGAMOE_SIDE_JOBS
inline constexpr bool kSideJobs = true;
#else
inline constexpr bool kSideJobs = false;
#endif

DevicePlan device_plan(const DevicePlanBuffers& b, const LayerDims& d);

// Whether an M-grouped GEMM walks its experts' tiles rows first
// (GroupedGemmArgs::rows_first): weights of elem_bytes a value over 10 MB an
// expert (unless built with -DMEGAMOE_ROWS_FIRST=OFF).
bool prefers_rows_first(const DevicePlan& plan, int64_t b_rows, int64_t b_cols, int elem_bytes);

// An M-grouped GEMM over the pool: A = pool [C, k], B = stacked expert weights [b_rows, b_cols].
GroupedGemmArgs pool_gemm(GemmMode mode, const LayerCall& call, const DevicePlan& plan, int64_t capacity,
                          const void* a, int64_t k, const void* b, int64_t b_rows, int64_t b_cols, int64_t n);

// The backward's data-gradient GEMMs over a pool holding dy: ga = dy @ w2[e]
// with its fused epilogue (d topk_w partials, dz into dz_pool, topk_w * a into
// a_pool), the partials reduced into d_topk [num_tokens * top_k], then the dx
// slots = dz @ w13[e] (c.slots, or the source ranks' return areas when
// dx_peer_slots is given: expert parallelism). w2 / w13: the plan's experts' weights.
// dy_tokens: dy's token rows [T, H], gathered by the GEMM (GroupedGemmArgs::gather),
// instead of the pool c.xdy_pool.
Status data_grad_gemms(const LayerCall& call, const DevicePlan& plan, const Carved& c, const void* w2, const void* w13,
                       const float* topk_weights, float* d_topk, int sms,
                       const GroupedGemmArgs::PeerSlots* dx_peer_slots = nullptr, const void* dy_tokens = nullptr);
// Its two halves: kDownGrad and the d topk_w reduction; kGateUpGrad's arguments.
Status down_grad_gemm(const LayerCall& call, const DevicePlan& plan, const Carved& c, const void* w2,
                      const float* topk_weights, float* d_topk, int sms, const void* dy_tokens = nullptr);

// Token rows [T, width] into c.xdy_pool as a GEMM's side job (GroupedGemmArgs::side_gather).
GroupedGemmArgs::SideGather pool_side_gather(const void* rows, int64_t width, const DevicePlan& plan, const Carved& c);
// The same pool made by scattering each token row once (SideGather::route_row);
// for GEMMs that do not hold tiles on the pool's rows.
GroupedGemmArgs::SideGather pool_side_scatter(const void* rows, int64_t width, const DevicePlan& plan,
                                              const Carved& c);
// g (kGateUp over c.xdy_pool) gathers its A from `rows` itself,
// each tile held until its 128 rows are counted in: the counts (u32 [C / 128])
// in c.dw_partial (f32 [C, I / 128], I a multiple of 128: the backward's,
// free until kDownGrad), zeroed on `stream` first.
Status gather_own_a(GroupedGemmArgs& g, const void* rows, const Carved& c, cudaStream_t stream);
// Launches such a g: holding tiles on its own gather needs every CTA resident
// at once, a cooperative launch. Where the SMs are partitioned (MPS) that
// launch is refused: *launched is then false, nothing ran, and the caller
// fills the pool by a kernel of its own and launches g without the gather.
Status launch_holding_own_rows(const GroupedGemmArgs& g, int sms, cudaStream_t stream, bool* launched);
GroupedGemmArgs gate_up_grad(const LayerCall& call, const DevicePlan& plan, const Carved& c, const void* w13,
                             const GroupedGemmArgs::PeerSlots* dx_peer_slots = nullptr);

// dW[e] = A_pool^T @ B_pool over each expert's rows (K-grouped).
GroupedGemmArgs weight_grad(const LayerCall& call, const DevicePlan& plan, int64_t capacity, const void* a,
                            int64_t m, const void* b, int64_t n, void* out, const LayerGrads& grads);

}  // namespace megamoe::cuda::detail
