// The grouped GEMM engine of the MoE layer (sm_90a; bf16 or e4m3 in, fp32
// accumulate). One persistent, warp-specialised kernel template serves every
// GEMM of the layer; the mode picks the operands, the grouping and the fused
// epilogue:
//
//  mode          C[M,N] =                       grouping   epilogue (outputs)
//  kGateUp       x_pool @ w13[e]^T   (K = H)     M by tile  z -> bf16 (z), a = silu(g) u -> bf16 (a)
//  kDown         a_pool @ w2[e]^T    (K = I)     M by tile  slot[j,t] = bf16(topk_w * C) (slots), or pool rows
//  kDownGrad     dy_pool @ w2[e]     (K = H)     M by tile  d topk_w partials, dz (and e4m3 dz), topk_w * a (wa)
//  kGateUpGrad   dz_pool @ w13[e]    (K = 2I)    M by tile  dx slot[j,t] = bf16(C) (slots)
//  kWeightGrad   A_pool^T @ B_pool   (K = rows)  K by expert dW[e] -> fp32 (or +=) / bf16 (dw)
//
// "M by tile": the pool's 128-row tiles each belong to one expert
// (tile_expert); their number is read on the device. "K by expert": one
// output tile per (expert, m, n), reducing over that expert's pool rows in
// order. Every output element is written by exactly one CTA, in a fixed
// order: results are deterministic.
//
// Which kernel runs is decided on the host before the launch, as a value
// (kernel_config.h: KernelConfig, select_kernel); launch_grouped_gemm
// selects and launches. Every mbarrier wait of the kernel is bounded by
// errors.timeout_ns: a wait that gives up reports (kernel, block, barrier,
// phase) to `errors` and the kernel exits without a trap, its outputs
// undefined (docs/gemm-engine.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_errors.h"
#include "cuda/fp8/quantize.h"
#include "megamoe/status.h"

namespace megamoe::cuda {

enum class GemmMode { kGateUp, kDown, kDownGrad, kGateUpGrad, kWeightGrad };
// The operands' element type: bf16, or e4m3 with fp32 block scales (the FP8 recipe).
enum class ElemType { kBF16, kE4M3 };
// The order of an M-grouped GEMM's tiles within an expert: all column tiles of
// one row tile next to each other (consecutive tiles share A rows in L2), or
// rows first (all row tiles of one column tile: consecutive tiles share B
// columns, for experts whose weights do not fit L2).
enum class TileOrder { kColumnsFirst, kRowsFirst };

inline constexpr int kBlockM = 128, kBlockN = 128, kBlockK = 64;

// The routing plan on the device (see moe/device_plan.h for how it is built).
struct DevicePlan {
  const int32_t* pool_rows = nullptr;      // [1]   rows used in the pool (multiple of 128)
  const int32_t* tile_expert = nullptr;    // [capacity / 128]  expert of each 128-row tile
  const int32_t* expert_offset = nullptr;  // [E]   first pool row of each expert
  const int32_t* expert_rows = nullptr;    // [E]   real rows of each expert
  const int32_t* row_src = nullptr;        // [capacity]  t * k + j of each row, -1 = padding
  const int32_t* route_row = nullptr;      // [T * k]     pool row of each route, -1 = none
  int num_tokens = 0, top_k = 0, num_experts = 0;
};

// A row-major device matrix; with e4m3 elements, its fp32 block scales.
struct GemmOperand {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
  const float* scales = nullptr;
};

// Expert parallelism (kDown, kGateUpGrad): slot rows go straight to their
// source rank's return area, over NVLink for another GPU's, instead of to
// the local slots: the output of route row v * k + j, virtual token v = s *
// tokens_per_rank + t, lands at bf16 element ((j * tokens_per_rank + t) * n)
// of rank_buffers[s] + offset. rank_buffers is the peer view's device array
// [world]. source_counts [world]: each source's token count this call (-1:
// missing); rows of a source at or past its count are not written, so a
// source that is missing or was judged inconsistent receives nothing.
struct PeerSlots {
  void* const* rank_buffers = nullptr;
  size_t offset = 0;
  int64_t tokens_per_rank = 0;
  const int64_t* source_counts = nullptr;
};

// What the epilogues read and write, by mode (null: not wanted, where the
// mode allows it). Pools are [a_rows, columns] in pool order.
struct GemmOutputs {
  // kGateUp
  void* z = nullptr;  // bf16 [C, 2I] (kept for the backward; null when not kept)
  void* a = nullptr;  // bf16 [C, I] silu(g) u (null when the backward recomputes z only)
  // kDown, kGateUpGrad: rows to their routes' slots, bf16 [top_k, T, n] (slot [j][t]),
  // or with peer_slots to the source ranks' return areas.
  void* slots = nullptr;
  PeerSlots peer_slots;
  // kDown, bf16 128 x 256 tiles: instead of slots, each pool row's output
  // times its routing weight in pool order, bf16 [C, n] (0 for padding rows);
  // the layer then sums each token's rows route_row[t k + j] (combine_pool_rows).
  void* pool_rows = nullptr;
  const float* topk_weights = nullptr;  // kDown, kDownGrad: [T, k]
  // kDownGrad
  const void* z_in = nullptr;     // bf16 [C, 2I], the forward's z
  void* dz = nullptr;             // bf16 [C, 2I]
  void* wa = nullptr;             // bf16 [C, I] topk_w * a (the dW2 operand)
  float* dw_partial = nullptr;    // f32 [C, I / 128] per-tile partial sums of d topk_w
  // kDownGrad, optional: dz also as e4m3 rows, quantised in the epilogue from
  // the bf16 dz it writes (bitwise what quantize_e4m3_rows makes of dz's
  // rows: 1 x 128 tiles, each tile column block's g or u half): dz_q [a.rows,
  // 2I] (8-byte aligned), dz_s [a.rows, 2I / 128]. Only the tiles' rows (the
  // pool's used rows) are written.
  uint8_t* dz_q = nullptr;
  float* dz_s = nullptr;
  Fp8Scale dz_scale = Fp8Scale::kFloat32;
  // kWeightGrad: dW [E, m, n], fp32 (overwritten, or added to) or bf16.
  void* dw = nullptr;
  bool dw_f32 = false;
  bool accumulate = false;
};

// Rows that arrive while the GEMM runs (bf16 kGateUp): pool tile m (rows
// 128m..) is loaded only once rows_ready[m] >= ready_value: whoever writes a
// tile's rows then adds to or stores its counter with release semantics (GPU
// scope, or system scope across GPUs). A growing ready_value (> 0) lets the
// same counters serve call after call. Residency: the GEMM's CTAs fill their
// SMs and do not leave while they wait, so a writer on this GPU must already
// be running when they start (or be the kernel's own side gather); a peer
// GPU or a copy engine has no such constraint. A tile whose rows never come
// times out.
struct RowArrival {
  const uint32_t* rows_ready = nullptr;  // [capacity / 128]
  uint32_t ready_value = 0;
};

// A side job (bf16 kWeightGrad): the producer warpgroup's three idle warps of
// every CTA combine token rows [begin, end) from their slots while the GEMM
// runs: out[t] = the fixed-order sum over t's valid routes j of slots[j][t]
// (combine_slots' arithmetic, bit for bit), every row NaN when error_key says
// the plan failed (reported by the launch with begin 0). None when out is null.
struct SideCombine {
  const void* slots = nullptr;  // [top_k][slot_tokens][hidden] bf16
  int64_t slot_tokens = 0;      // rows of one route's slot plane (>= tokens)
  const int32_t* topk_idx = nullptr;  // [tokens, top_k]
  int64_t tokens = 0;                 // all of them (topk_idx's rows)
  int64_t begin = 0, end = 0;         // the ones this launch combines
  int top_k = 0, num_experts = 0;
  int64_t hidden = 0;  // a multiple of 8
  const unsigned long long* error_key = nullptr;  // the routing plan's
  void* out = nullptr;  // [tokens][hidden] bf16
};

// A side job (bf16 kGateUp, kGateUpGrad, kWeightGrad): the idle producer
// warps copy token rows into a pool as gather_rows does (pool row r = src row
// row_src[r] / top_k, zeros where row_src is -1, rows [0, *pool_rows)) while
// the GEMM runs, which must neither read nor write the pool, unless it is
// kGateUp's own A. None when pool is null.
struct SideGather {
  const void* src = nullptr;  // [tokens][width] bf16
  int64_t width = 0;          // a multiple of 8
  const int32_t* row_src = nullptr;   // the plan's
  int top_k = 0;
  const int32_t* pool_rows = nullptr;  // the plan's (device)
  void* pool = nullptr;                // [capacity][width] bf16
  // kGateUp gathering its own A: each copied row counts into
  // rows_ready[row / 128] (released), the kernel's RowArrival with
  // ready_value 128, zeroed before the launch; the tiles hold until their 128
  // rows are in. Null elsewhere.
  uint32_t* rows_ready = nullptr;
  // Scatter instead (no rows_ready): warps walk the token rows, read each
  // once and store it to its routes' pool rows route_row[t top_k + j] (the
  // plan's, the inverse of row_src), then zero the padding rows: the same
  // pool with each token row read from DRAM once, not top_k times.
  const int32_t* route_row = nullptr;
  int64_t tokens = 0;
};

struct GroupedGemmArgs {
  GemmMode mode = GemmMode::kGateUp;
  DevicePlan plan;
  int64_t m = 0;  // kWeightGrad: rows of dW[e]; unused otherwise (rows come from the plan)
  int64_t n = 0;  // output columns (kGateUp: I, the a columns; z has 2I)
  int64_t k = 0;  // reduction length (M-grouped modes)
  int64_t intermediate = 0;
  // Operands, row-major (see the table above). bf16: A and B as the modes
  // read them (kDownGrad, kGateUpGrad: B MN-major, as [E * k, n]).
  // e4m3 (elem kE4M3): both K-major, with fp32 block scales (cuda/fp8/quantize.h
  // writes these layouts):
  //   a.scales [a.rows, k / 128]   1 x 128 along K, one per pool row and k-block;
  //   b.scales [b.rows / 128, k / 128]   128 x 128 blocks of b as [E * rows, k]
  //            (kGateUp, kDown); kDownGrad and kGateUpGrad read B transposed
  //            (b_transposed: [E * n, k], each expert's weights transposed, the
  //            block quantizer's q_t) with the untransposed weights' blocks
  //            [E, k / 128, n / 128] as scales.
  // FP8 kWeightGrad reads both operands transposed, K-major (K = pool rows):
  // a = A^T [m, C], b = B^T [n, C] (quantize_e4m3_cols_t), a.scales [C / 128,
  // m] and b.scales [C / 128, n] (128 pool rows of one channel each; it relies
  // on every expert starting on a 128-row boundary of the pool, as the device
  // plan lays them out), promoted per element by a_scale(row) *
  // b_scale(column). Each 128-long k-block is summed by wgmma into a
  // temporary, then added to the fp32 accumulator times a_scale * b_scale
  // (the recipe's promotion every 128 K). K must be a multiple of 128.
  ElemType elem = ElemType::kBF16;
  GemmOperand a, b;
  bool b_transposed = false;  // FP8 kDownGrad, kGateUpGrad: B as [E * n, k] (see above)
  TileOrder tile_order = TileOrder::kColumnsFirst;  // M-grouped modes
  GemmOutputs out;
  RowArrival arrival;
  SideCombine side_combine;
  SideGather side_gather;
  DeviceErrorSink errors;  // where a timed-out wait is reported (and its bound)
};

// What tests and benchmarks may ask of a launch beyond what the layer's
// arguments decide. The layer passes none.
struct GemmOverrides {
  // 128 x 128 tiles where the arguments would take 128 x 256 (refused where
  // that kernel is not built): the same products in the same order.
  bool narrow_tiles = false;
  // >= 0: the producer stops at this stage iteration, a stalled pipeline
  // (the timeout tests).
  int64_t stall_at = -1;
  // The main loops alone, nothing written (megamoe-gemm-bench's `noepi` rows:
  // what the epilogues cost).
  bool skip_epilogue = false;
};

// Selects the kernel (kernel_config.h) and launches it on `stream`. Host-side
// checks only (no synchronisation); a refusal names the rule it breaks.
Status launch_grouped_gemm(const GroupedGemmArgs& args, int num_sms, cudaStream_t stream,
                           const GemmOverrides& overrides = {});

}  // namespace megamoe::cuda
