// The problem description shared by every backend.
#pragma once

#include <cstdint>

#include "megamoe/status.h"
#include "megamoe/types.h"

namespace megamoe {

// Rows of the expert-major pool are padded per expert to this many rows: it
// is the GEMM tile height and the FP8 weight-gradient token group.
inline constexpr int kPoolRowAlign = 128;
// hidden and intermediate must be multiples of this (GEMM K/N tiling, FP8 groups).
inline constexpr int kDimAlign = 128;

// One rank's view of an expert-parallel MoE layer.
struct MoeProblem {
  int64_t num_tokens = 0;           // T on this rank, 0 <= T <= max_tokens_per_rank
  int64_t hidden = 0;               // H
  int64_t intermediate = 0;         // I (per expert; w13 has 2I rows)
  int num_experts = 0;              // E over all ranks
  int top_k = 0;                    // routes per token
  int ep_rank = 0;                  // this rank in the expert-parallel group
  int ep_size = 1;                  // P
  int64_t max_tokens_per_rank = 0;  // bound on num_tokens (EP capacity); 0 = num_tokens

  int experts_per_rank() const { return ep_size > 0 ? num_experts / ep_size : 0; }
  int64_t token_capacity() const { return max_tokens_per_rank > 0 ? max_tokens_per_rank : num_tokens; }
};

// Backend cuda: which of two paths to the same results the layer takes. Each
// pair gives bitwise the same outputs (GPU tests check it); the defaults are
// the faster ones as measured (docs/perf-log.md), the others stay for A/B
// measurements without a rebuild.
struct CudaPaths {
  // The bf16 layer's memory-bound steps (x's gather for GEMM1, x's scatter
  // for dW13, dx's combine) run in the GEMMs' idle producer warps instead of
  // kernels of their own.
  bool side_jobs = true;
  // Experts whose weights pass 10 MB walk their tiles rows first (few large
  // experts stream their weights from DRAM once, not once per row tile).
  bool rows_first = true;
  // The bf16 forward's kDown writes its rows in pool order, and the combine
  // sums them by route, instead of rows into slots [j][t].
  bool down_to_pool = true;
};

struct MoeOptions {
  Precision precision = Precision::kBF16;
  SavePolicy save_policy = SavePolicy::kKeep;
  Backend backend = Backend::kAuto;
  ScaleMode fp8_scale_mode = ScaleMode::kFloat32;
  // true: dw13/dw2 are fp32 accumulators and the gradients are added to them.
  bool accumulate_weight_grads = false;
  int cpu_threads = 0;  // 0 = hardware concurrency
  // Backend cuda: the cudaStream_t to run on (nullptr = the legacy default stream).
  void* cuda_stream = nullptr;
  // Backend cuda: synchronise at the end of the call and return any error the
  // kernels found (bad routing, a timed-out wait) from the call itself.
  bool validate = false;
  // Backend cuda: a device spin-wait that waits longer gives up, reports
  // kernel, block, barrier and phase, and the call fails with kTimeout.
  int64_t device_timeout_ms = 10000;
  CudaPaths cuda_paths;
};

// Checks the shape-level rules (alignment, divisibility, ranges).
Status validate_problem(const MoeProblem& p);

// Forward FLOPs: 6*T*k*H*I (routes that are -1 still counted: it is the nominal count).
double forward_flops(const MoeProblem& p);
// Backward FLOPs: 12*T*k*H*I, plus 4*T*k*H*I with the recompute policy.
double backward_flops(const MoeProblem& p, SavePolicy policy);

}  // namespace megamoe
