// The grouped GEMM engine of the MoE layer (sm_90a, bf16 in, fp32 accumulate).
// One persistent, warp-specialised kernel serves every GEMM of the layer; a
// mode picks the operand layouts, the grouping and the fused epilogue:
//
//  mode          C[M,N] =                       grouping   epilogue
//  kGateUp       x_pool @ w13[e]^T   (K = H)     M by tile  z -> bf16 (keep), a = silu(g) u -> bf16
//  kDown         a_pool @ w2[e]^T    (K = I)     M by tile  slot[j,t] = bf16(topk_w * C)
//  kDownGrad     dy_pool @ w2[e]     (K = H)     M by tile  ga -> d topk_w partials, dz (and e4m3 dz: dz_q), topk_w * a
//  kGateUpGrad   dz_pool @ w13[e]    (K = 2I)    M by tile  dx slot[j,t] = bf16(C)
//  kWeightGrad   A_pool^T @ B_pool   (K = rows)  K by expert dW[e] -> fp32 (or +=) / bf16
//
// "M by tile": the pool's 128-row tiles each belong to one expert
// (tile_expert); their number is read on the device. "K by expert": one
// output tile per (expert, m, n), reducing over that expert's pool rows in
// order. Every output element is written by exactly one CTA, in a fixed
// order: results are deterministic. Tiles: BLOCK_M = BLOCK_N = 128, BLOCK_K = 64.
//
// Every mbarrier wait of the kernel is bounded by errors.timeout_ns: a wait
// that gives up reports (kernel, block, barrier, phase) to `errors` and the
// kernel exits without a trap, its outputs undefined (docs/gemm-engine.md).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_errors.h"
#include "cuda/fp8/quantize.h"
#include "megamoe/status.h"

namespace megamoe::cuda {

enum class GemmMode { kGateUp, kDown, kDownGrad, kGateUpGrad, kWeightGrad };

inline constexpr int kBlockM = 128, kBlockN = 128, kBlockK = 64;

// The routing plan on the device (see moe/device_plan.h for how it is built).
struct DevicePlan {
  const int32_t* pool_rows = nullptr;      // [1]   rows used in the pool (multiple of 128)
  const int32_t* tile_expert = nullptr;    // [capacity / 128]  expert of each 128-row tile
  const int32_t* expert_offset = nullptr;  // [E]   first pool row of each expert
  const int32_t* expert_rows = nullptr;    // [E]   real rows of each expert
  const int32_t* row_src = nullptr;        // [capacity]  t * k + j of each row, -1 = padding
  const int32_t* route_row = nullptr;      // [T * k]     pool row of each route, -1 = none (quantizers only)
  int num_tokens = 0, top_k = 0, num_experts = 0;
};

struct GroupedGemmArgs {
  GemmMode mode = GemmMode::kGateUp;
  DevicePlan plan;
  int64_t m = 0;  // kWeightGrad: rows of dW[e]; unused otherwise (rows come from the plan)
  int64_t n = 0;  // output columns (kGateUp: I, the a columns; z has 2I)
  int64_t k = 0;  // reduction length (M-grouped modes)
  int64_t intermediate = 0;
  // Operands: row-major bf16 device arrays (see the table above).
  const void* a = nullptr;
  int64_t a_rows = 0, a_cols = 0;
  const void* b = nullptr;
  int64_t b_rows = 0, b_cols = 0;
  // kDownGrad, kGateUpGrad: B given transposed, K-major, as [E * n, k] (each
  // expert's weights transposed), instead of the MN-major [E * k, n] they
  // read by default. The same products in the same order (bitwise the same
  // result); the path FP8 needs, whose wgmma reads K-major operands only.
  bool b_k_major = false;
  // FP8 (kGateUp, kDown; kDownGrad and kGateUpGrad with b_k_major; kWeightGrad): a and b
  // are e4m3 (u8), both K-major, with fp32 block scales (cuda/fp8/quantize.h
  // writes these layouts):
  //   a_scales [a_rows, k / 128]   1 x 128 along K, one per pool row and k-block;
  //   b_scales [b_rows / 128, k / 128]   128 x 128 blocks of b as [E * rows, k]
  //            (kGateUp, kDown); with b_k_major, the blocks of the untransposed
  //            weights, [E, k / 128, n / 128] (quantize_e4m3_blocks' scales, whose
  //            q_t is this b).
  // kWeightGrad in FP8 reads both operands transposed, K-major (K = pool
  // rows): a = A^T [m, C], b = B^T [n, C] (quantize_e4m3_cols_t), a_scales
  // [C / 128, m] and b_scales [C / 128, n] (128 pool rows of one channel each;
  // it relies on every expert starting on a 128-row boundary of the pool, as
  // the device plan lays them out), promoted per element by
  // a_scale(row) * b_scale(column); one CTA per tile (no pairs).
  // Each 128-long k-block is summed by wgmma into a temporary, then added to
  // the fp32 accumulator times a_scale * b_scale (the recipe's promotion
  // every 128 K). K must be a multiple of 128. Outputs are bf16's (the staged
  // epilogues store from 64-row halves with plain stores in FP8).
  bool fp8 = false;
  // M-grouped FP8: a_scales as [k / 128, a_rows] instead (quantize.h's
  // RowScales::kByKBlock; a_rows a multiple of 4): a tile's 128 row scales of
  // one k-block are one 512-byte run, which the producer brings with the
  // stage into a scale ring beside it (as kWeightGrad's), so the consumers'
  // main loops load no scales of A from global memory. The same products in
  // the same order: bitwise the by-row layout's result. The scales' row
  // stride is a_rows: the quantizer must have been given a_rows rows.
  bool a_scales_by_k_block = false;
  const float* a_scales = nullptr;
  const float* b_scales = nullptr;
  // Epilogue operands (by mode).
  const float* topk_weights = nullptr;  // [T, k]
  const void* z_pool = nullptr;          // kDownGrad input [capacity, 2I]
  void* out0 = nullptr;  // kGateUp: z_pool | kDown, kGateUpGrad: slots [k, T, H] | kDownGrad: dz_pool | kWeightGrad: dW
  // Expert parallelism (kDown, kGateUpGrad): slot rows go straight to their
  // source rank's return area, over NVLink for another GPU's, instead of to
  // out0 (which is then unused): the output of route row v * k + j, virtual
  // token v = s * tokens_per_rank + t, lands at bf16 element
  // ((j * tokens_per_rank + t) * n) of rank_buffers[s] + offset. rank_buffers
  // is the peer view's device array [world]; null: out0, as on one GPU.
  // source_counts [world]: each source's token count this call (-1: missing);
  // rows of a source at or past its count are not written, so a source that
  // is missing or was judged inconsistent receives nothing.
  struct PeerSlots {
    void* const* rank_buffers = nullptr;
    size_t offset = 0;
    int64_t tokens_per_rank = 0;
    const int64_t* source_counts = nullptr;
  } peer_slots;
  void* out1 = nullptr;  // kGateUp: a_pool | kDownGrad: wa_pool [capacity, I]
  float* dw_partial = nullptr;  // kDownGrad: [capacity, I / 128]
  // kDownGrad, optional: dz also as e4m3 rows, quantised in the epilogue from
  // the bf16 dz it writes (bitwise what quantize_e4m3_rows makes of out0's
  // rows: 1 x 128 tiles, each tile column block's g or u half): dz_q
  // [a_rows, 2I] (8-byte aligned), dz_s [a_rows, 2I / 128], or [2I / 128, a_rows] with
  // dz_scales_by_k_block. Only the tiles' rows (the pool's used rows) are written.
  uint8_t* dz_q = nullptr;
  float* dz_s = nullptr;
  Fp8Scale dz_scale = Fp8Scale::kFloat32;
  bool dz_scales_by_k_block = false;
  bool out_f32 = false;         // kWeightGrad: fp32 output (else bf16)
  bool accumulate = false;      // kWeightGrad fp32: add to out0
  DeviceErrorSink errors;       // where a timed-out wait is reported (and its bound)
  // Rows that arrive while the GEMM runs (expert parallelism: tokens from
  // other ranks land in the pool during the call). M-grouped modes only. When
  // set, pool tile m (rows 128m..) is loaded only once rows_ready[m] >=
  // ready_value: whoever writes a tile's rows then adds to or stores its
  // counter with release semantics (GPU scope, or system scope across GPUs).
  // A growing ready_value (> 0) lets the same counters serve call after call.
  // Residency: the GEMM's CTAs fill their SMs and do not leave while they
  // wait, so a writer on this GPU must already be running when they start
  // (or the GEMM must leave it SMs: a smaller grid); a peer GPU or a copy
  // engine has no such constraint. A tile whose rows never come times out.
  const uint32_t* rows_ready = nullptr;  // [capacity / 128]
  uint32_t ready_value = 0;
  int64_t debug_stall_at = -1;  // tests only: >= 0 makes the producer stop at this stage iteration
  // Timing only (megamoe-gemm-bench's `noepi` rows): the main loops alone, no
  // epilogue (nothing is written, kDownGrad loads no z): what the epilogues
  // cost (FP8 kGateUp at 235B: ~10%, session 25).
  bool debug_skip_epilogue = false;
  // Clusters of two CTAs sharing A by TMA multicast, in the modes where that is
  // faster (ModeTraits::kPairs: kWeightGrad) and when n_tiles is even; tests
  // set false to compare with the one-CTA path.
  bool pair_ctas = true;
  // bf16 runs in 128 x 256 tiles, both consumers on each, when rows_ready is
  // unset and no rows are gathered: kGateUp (128 gate + 128 up columns) when
  // I is a multiple of 128; kDown when N is a multiple of 256 (no
  // peer_slots); kGateUpGrad (B as given, no peer_slots) and kWeightGrad
  // (instead of its CTA pairs) when N is a multiple of 256. Tests set true
  // to compare with the 128 x 128 tiles, which are bitwise the same (the
  // same products summed in the same order). The backward's wide tiles:
  // kGateUpGrad -11%, dW2 -4%, dW13 -3% at Qwen3-235B-A22B (session 34).
  bool narrow_tiles = false;
  // kDown in 128 x 256 tiles (bf16; n a multiple of 256; no peer_slots,
  // rows_ready or narrow_tiles): out0 is [a_rows][n] bf16 in pool order, row
  // r = pool row r's output times its routing weight (0 for padding rows),
  // stored by TMA as 64 x 64 boxes, instead of the slots [top_k][T][n]; the
  // layer then sums each token's rows route_row[t k + j] (combine_pool_rows).
  // The bf16 layer's default (-DMEGAMOE_DOWN_POOL, on): kDown 686 -> 651 us
  // at Qwen3-30B-A3B, 2470 -> 2378 at 235B (Nsight, session 38); 150
  // back-to-back fwd+bwd steps at 30B -0.4% (session 40).
  bool down_to_pool = false;
  // M-grouped modes (held tiles too): walk each expert's tiles rows first
  // (all its 128-row tiles of one column tile, then the next column tile)
  // instead of columns first. Concurrently running tiles then share a few
  // column tiles of B (the weights) instead of needing all of the expert's:
  // for few large experts (Mixtral: 235 MB of w13 an expert, over 100 tiles
  // an expert) columns first streams B from DRAM once per row tile. Where an
  // expert's tiles fit in one wave of CTAs, the two orders run the same tiles
  // at once. Bitwise the columns-first result (tests).
  bool rows_first = false;
  // A side job (bf16 kWeightGrad, rows not gathered): the producer
  // warpgroup's three idle warps of every CTA combine token rows [begin, end)
  // from their slots while the GEMM runs: out[t] = the fixed-order sum over
  // t's valid routes j of slots[j][t] (combine_slots' arithmetic, bit for
  // bit), every row NaN when error_key says the plan failed (reported by the
  // launch with begin 0). None when out is null. The bf16 layer's dx
  // combine rides in dW13.
  struct SideCombine {  // (tokens [begin, end): a combine may be split over launches)
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
  SideCombine side_combine;
  // A side job (bf16 kGateUpGrad or kWeightGrad, rows not gathered): the
  // idle producer warps copy token rows into a pool as gather_rows does
  // (pool row r = src row row_src[r] / top_k, zeros where row_src is -1, rows
  // [0, *pool_rows)) while the GEMM runs, which must neither read nor write
  // the pool. None when pool is null. The bf16 layer gathers x for dW13 in
  // kGateUpGrad, and the forward's x for kGateUp itself (rows_ready below).
  struct SideGather {
    const void* src = nullptr;  // [tokens][width] bf16
    int64_t width = 0;          // a multiple of 8
    const int32_t* row_src = nullptr;   // the plan's
    int top_k = 0;
    const int32_t* pool_rows = nullptr;  // the plan's (device)
    void* pool = nullptr;                // [capacity][width] bf16
    // kGateUp gathering its own A: each copied row counts into
    // rows_ready[row / 128] (released), the kernel's rows_ready with
    // ready_value 128, zeroed before the launch; the tiles hold until their
    // 128 rows are in (wide tiles allowed). Null elsewhere.
    uint32_t* rows_ready = nullptr;
    // Scatter instead (no rows_ready): warps walk the token rows, read each
    // once and store it to its routes' pool rows route_row[t top_k + j] (the
    // plan's, the inverse of row_src), then zero the padding rows: the same
    // pool with each token row read from DRAM once, not top_k times.
    const int32_t* route_row = nullptr;
    int64_t tokens = 0;
    // Token rows spread over several ranks' buffers (expert parallelism: the
    // owner's kGateUp pulling each pool row from its source rank, over NVLink
    // for another GPU's): with source_buffers (a device array of `sources`),
    // token row v lives in source_buffers[v / tokens_per_source] at byte
    // offset source_offset + v * width * 2, and src is unused. Gather form only.
    void* const* source_buffers = nullptr;
    size_t source_offset = 0;
    int tokens_per_source = 0, sources = 0;
  };
  SideGather side_gather;
  // bf16 kDownGrad in 128 x 256 tiles too (B as given, N a multiple of 256,
  // no row holds, rows pooled or A gathered): each consumer's z chunk is a
  // column half of its 64 rows. Bitwise the 128 x 128 tiles' result (GPU
  // tests, session 35). Faster only when A is gathered (Qwen3-30B-A3B -8%,
  // 235B -25%); pooled, 13% and 3% slower (both consumers' heavy epilogues
  // at once): the layer asks for it when it gathers dy.
  bool wide_down_grad = false;
  // Gathered rows (bf16, the one-GPU layer): the operand named here is the
  // token matrix itself, [gather_tokens, its cols], instead of a pool made
  // of it by gather_rows: the producer threads copy pool row r from token row
  // row_src[r] / top_k (the plan's) by cp.async, and a padding row (row_src
  // -1) as zeros. Bitwise the pool path's result, with no pool to write and
  // read. kA: kGateUp's x, kDownGrad's dy (B as given, not b_k_major),
  // kWeightGrad's A; kB: kWeightGrad's B (kWeightGrad in the 128 x 256 tiles
  // where N % 256 == 0, else A one CTA a tile, B in pairs). a_rows and
  // b_rows still count the pool's rows (the epilogues' maps use them).
  // Not used by the layer (-DMEGAMOE_GATHER_ROWS=ON for A/B runs): on one
  // H200 these kernels ran 1.12-2.25x the pooled ones' time, more than the
  // gather_rows launches they would replace (perf-log, session 34).
  enum class Gather { kNone, kA, kB };
  Gather gather = Gather::kNone;
  int64_t gather_tokens = 0;
};

// Launches the engine on `stream`. Host-side checks only (no synchronisation).
Status launch_grouped_gemm(const GroupedGemmArgs& args, int num_sms, cudaStream_t stream);

}  // namespace megamoe::cuda
