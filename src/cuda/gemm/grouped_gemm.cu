// The grouped GEMM engine: a persistent kernel with a producer thread issuing
// TMA loads into a ring of shared-memory stages (the FP8 kernels: one per
// consumer ring, pipeline.cuh) and two consumer warpgroups
// that take the CTA's tiles in turn ("ping-pong"): while one runs a tile's
// wgmma main loop the other runs the previous tile's fused epilogue, so the
// tensor cores do not wait for epilogues. Epilogues stage bf16 output through
// shared memory so that global stores are 16-byte, row-contiguous. (bf16
// kGateUp and kDown instead run 128 x 256 tiles with both consumers on
// each: kWide.)
//
// The parts: engine_config.cuh (shapes, register split, shared-memory budget),
// pipeline.cuh (stage ring, pipeline state, order barriers, bounded waits),
// tile_scheduler.cuh (which tiles, in what order), epilogues.cuh (one functor
// per mode). This file: the loads and the kernel that ties them together.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <atomic>
#include <string>
#include <type_traits>

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/common/cuda_status.h"
#include "cuda/gemm/engine_config.cuh"
#include "cuda/gemm/epilogues.cuh"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/gemm/route_division.h"
#include "cuda/gemm/side_jobs.cuh"
#include "cuda/gemm/tensor_map.h"
#include "cuda/gemm/tile_scheduler.cuh"
#include "cuda/ptx/sm90.cuh"

namespace megamoe::cuda {
namespace {

using namespace ptx;
using namespace engine;

// TMA loads of one k-block of a tile: A and B, each as two 64 x 64 boxes.
// kPair: the two CTAs of a cluster compute tiles with the same A rows (n and
// n + 1), so CTA `rank` loads A box `rank` only and multicasts it to both.
// kBT: kDownGrad / kGateUpGrad with B transposed, K-major (GroupedGemmArgs::b_k_major).
// kFp8: e4m3 operands, 128 elements per k-block (the same 128-byte box rows).
// kWide (bf16; the kernel's 128 x 256 tiles): kGateUp's 128 gate rows into B
// boxes 0-1 and the matching 128 up rows into boxes 2-3; kDown's 256 rows of
// expert e's w2 (output columns 256n..) into boxes 0-3; kGateUpGrad's and
// kWeightGrad's B (MN-major) as four 64-column boxes of the tile's 256.
// kGather: the operand the producer warpgroup gathers (RowGather) is skipped here.
template <GemmMode M, bool kPair, bool kBT, bool kFp8, bool kWide = false, int kGather = kGatherNone>
__device__ __forceinline__ void load_stage(const KernelParams& p, const CUtensorMap* map_a,
                                           const CUtensorMap* map_b, const Tile& tile, int kb, uint8_t* smem_a,
                                           uint8_t* smem_b, uint64_t* full, uint32_t rank) {
  using T = ModeTraits<M>;
  const int k0 = tile.k_begin + kb * (kFp8 ? kBlockKFp8 : kBlockK);
  const int e = tile.expert;
  const int I = static_cast<int>(p.args.intermediate);
  for (int box = 0; box < 2; ++box) {
    // A. Rows 64..127 of an expert's last tile are often padding (zeros in the
    // pool): box 1 is then asked for past the tensor's end, which TMA fills
    // with zeros without reading memory (Tile::lower_half_used).
    const int a_row = box == 1 && !tile.lower_half_used ? static_cast<int>(p.args.a_rows) : tile.m * kBlockM + box * 64;
    constexpr bool kAMn = T::kAMnMajor && !kFp8;  // FP8 kWeightGrad reads A^T, K-major
    const int c0 = kAMn ? a_row : k0, c1 = kAMn ? k0 : a_row;
    if constexpr (kGather == kGatherA) {
      // gathered by the producer warpgroup (RowGather)
    } else if constexpr (kPair) {
      if (box == static_cast<int>(rank)) tma_load_2d_multicast(smem_a + box * kBoxBytes, map_a, full, c0, c1, 0b11);
    } else {
      tma_load_2d(smem_a + box * kBoxBytes, map_a, full, c0, c1);
    }
    // B
    if constexpr (kGather == kGatherB) {
      static_assert(M == GemmMode::kWeightGrad, "B is gathered in kWeightGrad only");
    } else if constexpr (M == GemmMode::kGateUp && kWide) {  // gate rows 128n + 64 box, and their up rows
      const int row = e * 2 * I + tile.n * 128 + box * 64;
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, row);
      tma_load_2d(smem_b + (2 + box) * kBoxBytes, map_b, full, k0, row + I);
    } else if constexpr (M == GemmMode::kGateUp) {  // gate rows and the matching up rows
      const int row = e * 2 * I + (box == 0 ? 0 : I) + tile.n * 64;
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, row);
    } else if constexpr (M == GemmMode::kDown && kWide) {
      const int row = e * static_cast<int>(p.args.n) + tile.n * 256 + box * 64;
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, row);
      tma_load_2d(smem_b + (2 + box) * kBoxBytes, map_b, full, k0, row + 128);
    } else if constexpr (M == GemmMode::kDown) {
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, e * static_cast<int>(p.args.n) + tile.n * kBlockN + box * 64);
    } else if constexpr (M == GemmMode::kWeightGrad && kFp8) {  // B^T [n, pool rows], K-major
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, tile.n * kBlockN + box * 64);
    } else if constexpr (M == GemmMode::kWeightGrad && kWide) {  // B's 256 columns: boxes 0-3, 64 columns each
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, tile.n * 256 + box * 64, k0);
      tma_load_2d(smem_b + (2 + box) * kBoxBytes, map_b, full, tile.n * 256 + (2 + box) * 64, k0);
    } else if constexpr (M == GemmMode::kWeightGrad) {
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, tile.n * kBlockN + box * 64, k0);
    } else if constexpr ((M == GemmMode::kGateUpGrad || M == GemmMode::kDownGrad) && kWide) {
      // w13[e]'s (kDownGrad: w2[e]'s) 256 columns as four boxes, K rows
      static_assert(!kBT, "wide kGateUpGrad and kDownGrad read B as given (MN-major)");
      const int row = e * static_cast<int>(p.args.k) + k0;
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, tile.n * 256 + box * 64, row);
      tma_load_2d(smem_b + (2 + box) * kBoxBytes, map_b, full, tile.n * 256 + (2 + box) * 64, row);
    } else if constexpr (kBT) {  // [E * n, k]: expert e's output columns are rows, K inner
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0,
                  e * static_cast<int>(p.args.n) + tile.n * kBlockN + box * 64);
    } else {  // kDownGrad (w2 as [E*H, I]) and kGateUpGrad (w13 as [E*2I, H]): K = rows of expert e
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, tile.n * kBlockN + box * 64,
                  e * static_cast<int>(p.args.k) + k0);
    }
  }
}

// Gathered rows (GroupedGemmArgs::gather): the 128 producer threads copy the
// gathered operand's part of each stage from token rows by cp.async, 16
// bytes a copy, into the layout a TMA box load with the 128-byte swizzle
// makes (16-byte chunk c of box row r at chunk c ^ (r % 8)); one TMA load a
// row measured 5x slower (the TMA unit takes ~60 cycles a request). A copy
// of a padding row (row_src -1) reads nothing and writes zeros.
// Thread t copies chunk t % 8 of 8 rows, each eight threads one 128-byte
// row (coalesced): M-grouped (K-major A, 128 tile rows x the k-block's 64
// columns): rows i * 16 + 4 w + j (warp w, j = lane / 8, i < 8), the same
// rows for all of a tile's k-blocks. kWeightGrad (MN-major; K = pool rows):
// the k-block's 64 pool rows x the tile's 128 columns as kBoxes = 2
// 64-column boxes (a wide tile's gathered B: its 256 columns, 4 boxes): box
// i / 4, pool row (i % 4) * 16 + 4 w + j, four rows a k-block.
// Row r's swizzle, r % 8 = (4 w + j) % 8, is the same for all of a thread's
// rows: its copies land at one offset plus constants.
// The producer warps have 40-56 registers and share their schedulers with the
// consumers, so a copy is an address add and the cp.async: each thread
// looks its rows' tokens up once (M-grouped: a tile; kWeightGrad: a k-block,
// one ahead) into 16-byte-unit offsets. Looking them up by shuffle and
// multiplying per copy ran the producer out of issue slots (~320
// instructions a warp a stage; the gathering kGateUp 1.5x the pooled one,
// Nsight Compute, session 34).
template <GemmMode M, int kBoxes = 2>
struct RowGather {
  static constexpr bool kWgrad = M == GemmMode::kWeightGrad;
  static_assert(kBoxes == 2 || (kWgrad && kBoxes == 4), "four boxes: a wide kWeightGrad's gathered B");
  static constexpr int kRows = kWgrad ? 4 : 8;  // this thread's rows a stage
  static constexpr int kCopies = kWgrad ? 4 * kBoxes : 8;  // this thread's copies a stage
  const char* rows;   // the token matrix, advanced to this thread's chunk (and kWeightGrad: the tile's columns)
  uint32_t pitch16;   // its row length in 16-byte units
  RouteDivisor top_k;  // token = route / top_k
  uint32_t dst;       // this thread's byte offset in a stage's gathered operand

  __device__ __forceinline__ static int warp() { return static_cast<int>(threadIdx.x / 32) & 3; }
  __device__ __forceinline__ static int lane_row() { return 4 * warp() + static_cast<int>((threadIdx.x & 31) >> 3); }
  // Pool row `row`'s offset in 16-byte units into `off`, and whether it is a token's (not padding).
  __device__ __forceinline__ uint32_t look_up(const KernelParams& p, int64_t row, uint32_t& off) const {
    const int src = __ldg(p.args.plan.row_src + row);
    const uint32_t u = static_cast<uint32_t>(src);
    off = src < 0 ? 0u : top_k.divide(u) * pitch16;
    return src >= 0 ? 1u : 0u;
  }
  // The offsets of this thread's rows from pool row `first` on (M-grouped: the tile's first row;
  // kWeightGrad: the k-block's); bit i of the result: row i is a token's.
  __device__ __forceinline__ uint32_t look_up_all(const KernelParams& p, int64_t first, uint32_t (&off)[kRows]) const {
    uint32_t valid = 0;
#pragma unroll
    for (int i = 0; i < kRows; ++i) valid |= look_up(p, first + i * 16 + lane_row(), off[i]) << i;
    return valid;
  }
  // This thread's copies for k-block kb into the stage whose gathered
  // operand starts at shared-window address `stage`.
  __device__ __forceinline__ void copy(uint32_t stage, int kb, const uint32_t (&off)[kRows], uint32_t valid) const {
    const uint32_t to = stage + dst;
    const char* from = kWgrad ? rows : rows + kb * kBlockK * 2;
    // One 64-bit base a stage, opaque to ptxas: each copy's address is then one
    // IMAD.WIDE (left alone, it added the matrix's base per copy: 3 instructions).
    asm("" : "+l"(from));
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int row = kWgrad ? i & 3 : i, box = kWgrad ? i >> 2 : 0;
      cp_async_16(to + box * kBoxBytes + row * 16 * 128, from + box * 128 + static_cast<uint64_t>(off[row]) * 16,
                  (valid >> row) & 1u);
    }
  }
};

// The FP8 main loop of one tile (kGateUp, kDown; kDownGrad and kGateUpGrad
// with B transposed, kBT; kWeightGrad with both transposed). Each 128-long
// k-block is summed in two halves (h: rows [64h, 64h + 64), all 128
// columns), each by four m64n128k32 wgmmas into a 64-register temporary
// (scale_d = 0 starts it afresh), then added to acc[h] times a_scale(row) *
// b_scale(column block): the recipe's promotion every 128 K. The wait before
// each promotion leaves this warpgroup's tensor-core slots idle; on split
// rings the other consumer's main loop fills them (n64 quarters with two
// alternating temporaries, pipelined inside one warpgroup, measured no
// faster on split rings and 5-11% slower in kWeightGrad: perf-log, session
// 22). kGateUp's column halves are its gate and up columns
// (two scale blocks of B), the other modes' 128 columns one block. B's scales:
// [b_rows / 128, k / 128] for B as given (kGateUp, kDown); with kBT, the
// untransposed weights' blocks, [E, k / 128, n / 128] (the block quantizer's
// layout, whose transposed copy is this B).
// kARing (M-grouped, a_scales_by_k_block): A's row scales come from the
// stage's scale-ring slot, as kWeightGrad's do, instead of global memory.
// false: a wait gave up (reported); the stage's wgmmas are retired.
template <GemmMode M, bool kBT, bool kARing, int S, typename Release>
__device__ __forceinline__ bool fp8_main_loop(const KernelParams& p, const Tile& tile, const uint8_t* smem,
                                              const float* scale_ring, const StageRing<S>& ring, const BoundedWait& waits,
                                              PipelineState<S>& ps, float (&acc)[2][64], Release&& release) {
  static_assert(M == GemmMode::kGateUp || M == GemmMode::kDown || M == GemmMode::kWeightGrad ||
                    (kBT && (M == GemmMode::kDownGrad || M == GemmMode::kGateUpGrad)),
                "FP8: the modes with both operands K-major");
  constexpr bool kWgrad = M == GemmMode::kWeightGrad;
  static_assert(kAccPerThread + 64 + 32 <= RegisterSplit<true>::kConsumer,
                "FP8's promotion temporary does not fit the consumer");
  const int kbs = static_cast<int>(p.args.k / kBlockKFp8);  // scale columns (M-grouped modes)
  // This thread's accumulator rows (acc_row): r and r + 8 of each half.
  const int r0 = tile.m * kBlockM + acc_row(0, 0);
  // Its A scales (M-grouped): a_scales[sa + (64 h + 8 q) * kbs + kb]. kWeightGrad
  // scales A^T per row and B^T per column of each k-block: both from the
  // stage's scale ring (the producer's bulk loads), [A 128 | B 128].
  // Offsets, not pointers (registers: the consumers have 232, the accumulators take 192).
  const int sa = r0 * kbs;
  // B's 128-row scale blocks of this tile's columns: kGateUp's 64 gate and 64
  // up columns sit in two blocks, kDown's 128 columns in one.
  // b_scales[sb + kb * sb_step]: the scale of k-block kb for the first 64
  // columns, sb_up further on for the other 64 (kGateUp's up columns, I / 128
  // blocks on: FP8 kGateUp needs I % 128 == 0, launch_grouped_gemm checks).
  // kWeightGrad: per column, from the ring.
  int sb = 0, sb_step = 1;
  const int sb_up = M == GemmMode::kGateUp ? static_cast<int>(p.args.intermediate / 128) * kbs : 0;
  if constexpr (kBT) {
    const int nb = static_cast<int>(p.args.n / 128);
    sb = tile.expert * kbs * nb + tile.n;
    sb_step = nb;
  } else if constexpr (M == GemmMode::kGateUp) {
    const int I = static_cast<int>(p.args.intermediate);
    sb = (tile.expert * 2 * I + tile.n * 64) / 128 * kbs;
  } else if constexpr (!kWgrad) {
    sb = (tile.expert * static_cast<int>(p.args.n) + tile.n * kBlockN) / 128 * kbs;
  }
  // The global scales (B's; A's without the ring) of k-block kb. They are
  // loaded one k-block ahead: a load issued just before its k-block's wgmmas
  // came back after them, and the promotion's multiply waited for it (FP8
  // kDownGrad: 9% of its stall samples on that FMUL, session 28).
  // b[c]: column block c's; a[h][q]: row (h, q)'s (with the ring, from the stage instead).
  struct Scales {
    float b[2] = {1.0f, 1.0f};
    float a[2][2] = {{1.0f, 1.0f}, {1.0f, 1.0f}};
  };
  auto load_scales = [&](int kb) {
    Scales s;
    if constexpr (!kWgrad) s.b[0] = __ldg(p.args.b_scales + sb + kb * sb_step), s.b[1] = __ldg(p.args.b_scales + sb + sb_up + kb * sb_step);
    if constexpr (!kWgrad && !kARing) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 2; ++q) s.a[h][q] = __ldg(p.args.a_scales + sa + (64 * h + 8 * q) * kbs + kb);
    }
    return s;
  };
  float tmp[64];
  Scales cur;  // k-block kb's
  if (tile.k_blocks > 0) cur = load_scales(0);
  for (int kb = 0; kb < tile.k_blocks; ++kb, ++ps) {
    // k-block kb + 1's (kb's again on the last: a valid address, no branch).
    const Scales next = load_scales(kb + 1 < tile.k_blocks ? kb + 1 : kb);
    if (!ring.wait_full(waits, ps)) return false;
    const float* stage_scales = scale_ring + ps.stage() * (kScaleStageBytes / 4);  // kWeightGrad, kARing
    if constexpr (kWgrad || kARing) {  // the tile's row r's scale at stage_scales[r]
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 2; ++q) cur.a[h][q] = stage_scales[acc_row(h, 2 * q)];
    }
    const uint8_t* stage_a = smem + ps.stage() * kStageBytes;
    const uint8_t* stage_b = stage_a + kTileBytesA;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows [64h, 64h + 64): A box h, all 128 columns of B
      fence_accumulators(tmp);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {  // 4 x k32 = one 128-byte row
        const uint64_t da = smem_desc_sw128(stage_a + h * kBoxBytes + kk * 32, 0, 1024);
        const uint64_t db = smem_desc_sw128(stage_b + kk * 32, 0, 1024);
        wgmma_m64n128k32_e4m3(tmp, da, db, kk > 0 ? 1 : 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(tmp);
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        // Column acc_col(i): the first 64 columns in registers 0..31 (B scale block 0), the rest in 32..63.
        const float b = kWgrad ? stage_scales[128 + acc_col(i)] : cur.b[i >> 5];
        acc[h][i] += tmp[i] * (cur.a[h][(i >> 1) & 1] * b);
      }
    }
    release(ps.stage());  // with a scale ring: every lane, after its own scale reads (see kLaneRelease)
    cur = next;  // the ring's row scales are read again from the next stage
  }
  return true;
}

// kPair: launched as clusters of two CTAs sharing A (see load_stage); every
// stage's empty barrier then also counts the peer consumer's warps, because
// the peer's multicast writes into this CTA's stage. kHoldRows: the producer
// holds each tile until its rows are in (GroupedGemmArgs::rows_ready); its own
// instantiation, because the check in the producer's tile loop cost the
// M-grouped modes 3-8% even when never taken (Nsight Compute, session 18).
// kBT, kFp8: as load_stage. FP8 kernels run on split rings (pipeline.cuh:
// one ring per consumer, main loops at the same time). kARing: M-grouped FP8
// with A's scales through a scale ring (GroupedGemmArgs::a_scales_by_k_block).
// kWide: bf16 kGateUp in 128 x 256 tiles (128 gate + 128 up columns, whole
// SwiGLU pairs), and bf16 kDown, kGateUpGrad and kWeightGrad in 128 x 256
// tiles (GroupedGemmArgs::narrow_tiles unset); both consumers on every tile at once, consumer c on rows [64c, 64c + 64) with one m64n256k16 a
// k-step; a stage is released when both have read it. The bare loop of this shape ran 9-13% faster than the
// 128 x 128 split one in bench/fp8_tile_probe.cu (perf-log, session 31).
// kGather (kGatherA, kGatherB): that operand's rows are gathered from token
// rows by the producer warpgroup (GroupedGemmArgs::gather); bf16, no row holds.
template <GemmMode M, bool kPair, bool kHoldRows, bool kBT, bool kFp8, bool kARing, bool kWide = false,
          int kGather = kGatherNone>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_z, const __grid_constant__ CUtensorMap map_out0,
                        const __grid_constant__ CUtensorMap map_out1, const __grid_constant__ KernelParams p) {
  using Tr = ModeTraits<M>;
  constexpr int S = kWide ? kWideStagesOf<M> : Tr::kStages;
  constexpr bool kBMn = Tr::kBMnMajor && !kBT;  // B's layout in shared memory
  constexpr bool kSplitRings = kFp8;
  constexpr bool kRing = has_scale_ring<M, kFp8, kARing>;
  static_assert(!kARing || (kFp8 && M != GemmMode::kWeightGrad), "kARing: the M-grouped FP8 modes");
  constexpr int kRingBytes = kScaleRingBytes<M, kFp8, kRing>;
  constexpr int R = kSplitRings ? S / 2 : S;  // stages of one consumer's ring
  static_assert(!(kSplitRings && (kPair || kHoldRows)), "split rings: one CTA per tile, no row holds");
  static_assert(!kWide || (!kFp8 && !kPair && !kBT && (!kHoldRows || M == GemmMode::kGateUp)),
                "wide tiles: bf16, B as given, one CTA a tile, no row holds but kGateUp's");
  static_assert(kGather == kGatherNone ||
                    (!kFp8 && !kHoldRows &&
                     (kGather == kGatherA ? M == GemmMode::kGateUp || (M == GemmMode::kDownGrad && !kBT) ||
                                                M == GemmMode::kWeightGrad
                                          : M == GemmMode::kWeightGrad)),
                "gathered rows: bf16 kGateUp's, kDownGrad's (B as given) and kWeightGrad's A, kWeightGrad's B");
  constexpr int kRowRows = kRowDstRows<kWide>;  // tile rows a consumer's row destinations cover
  constexpr int kStage = kStageBytesOf<kWide>;  // bytes of one ring stage
  using State = PipelineState<S>;
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment: the 128B swizzle pattern repeats every 1024 bytes.
  // Rounded as a shared-window address and converted back, every pointer
  // derived from smem stays known to the compiler as shared memory, so that
  // their accesses compile to LDS / STS; rounded through uintptr_t they were
  // generic LD.E / ST.E (staging, row_dst, row_w, the scale ring: session 28's
  // SASS). kDownGrad keeps the integer form: its epilogue already addresses
  // the z chunk through shared addresses, and the shared form cost its bf16
  // kernels a 4-byte spill.
  uint8_t* smem = M == GemmMode::kDownGrad
                      ? reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023})
                      : static_cast<uint8_t*>(__cvta_shared_to_generic((smem_u32(smem_raw) + 1023u) & ~1023u));
  // The scale ring [stages used][A 128 | B 128] f32 (kScaleRingBytes), then the epilogue buffers.
  constexpr int kStageArea = (kWide ? kWideStagesOf<M> : kStagesUsed<M, kFp8, kRing>) * kStage;
  float* scale_ring = reinterpret_cast<float*>(smem + kStageArea);
  constexpr int kEpilogueBytes = kWide ? kWideEpilogueBytesOf<M> : kEpilogueBytesOf<M, kFp8>;
  uint8_t* epilogue_base = smem + kStageArea + kRingBytes;  // [2][kEpilogueBytes], one per consumer
  auto* barriers = reinterpret_cast<uint64_t*>(epilogue_base + 2 * kEpilogueBytes);
  const StageRing<S> ring{barriers, barriers + S};
  const OrderBarriers order{barriers + 2 * S};  // [2]
  uint64_t* z_full = barriers + 2 * S + 2;      // [2] kDownGrad: a consumer's z chunk has landed
  auto* row_dst_base = reinterpret_cast<__nv_bfloat16**>(barriers + Tr::kBarriers);  // [2][kRowRows]
  auto* row_w_base = reinterpret_cast<float*>(row_dst_base + 2 * kRowRows);           // kDown: [2][kRowRows]
  // The CTA's state word (BoundedWait): abort and holding-for-rows bits.
  auto* cta_state = reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(row_dst_base) + kRowDstBytesOf<M, kWide>);
  // What is carved above, with the worst alignment pad (1008 bytes) and the
  // state word, inside what the launch asks for (the budget in engine_config.cuh
  // repeats this layout by hand).
  static_assert(!kWide || 1008 + kStageArea + 2 * kEpilogueBytes + Tr::kBarriers * 8 + kRowDstBytesOf<M, kWide> + 4 <=
                              kSmemBytesWide<M>,
                "the wide kernel's shared-memory carve-up exceeds kSmemBytesWide");
  constexpr uint32_t kKernel = !kWide                        ? kernel_id<M>()
                              : M == GemmMode::kGateUp      ? kKernelGemmGateUpWide
                              : M == GemmMode::kDown        ? kKernelGemmDownWide
                              : M == GemmMode::kGateUpGrad  ? kKernelGemmGateUpGradWide
                              : M == GemmMode::kDownGrad    ? kKernelGemmDownGradWide
                                                            : kKernelGemmWeightGradWide;
  const BoundedWait waits{p.args.errors, cta_state, kKernel, kHoldRows};
  const TileScheduler<M, kFp8> scheduler{p};

  // With a scale ring (FP8 kWeightGrad, kARing) lanes read the stage's ring slot with ordinary loads
  // (the other stages are read by wgmma only): each lane's arrival orders its
  // own reads before the producer's next bulk copy into the slot. A warp
  // leader's arrival after __syncwarp is enough under the PTX memory model,
  // but compute-sanitizer racecheck does not see it (hazards, session 20),
  // nor a named barrier of the warpgroup before 4 leader arrivals (session 27:
  // hazards on kWeightGrad's and kARing's scale reads; reverted).
  constexpr bool kLaneRelease = kRing;
  static_assert(!(kLaneRelease && kPair), "kernels with a scale ring run one CTA per tile");
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&ring.full[s], kGather != kGatherNone ? 1 + 128 : 1);  // + each gathering thread's
      // one arrival per warp (per lane with kLaneRelease) of the consumer(s) that read the stage
      mbar_init(&ring.empty[s], kLaneRelease ? 128 : kPair || kWide ? 8 : 4);
    }
    for (int c = 0; c < 2; ++c) {
      mbar_init(&order.bar[c], 1);
      mbar_init(&z_full[c], 1);
    }
    *cta_state = 0u;
    fence_barrier_init();
  }
  // A pair's peer arrives on these barriers and multicasts into this CTA's
  // stages: both CTAs' inits come first.
  if constexpr (kPair) {
    cluster_sync();
  } else {
    __syncthreads();
  }
  const uint32_t rank = kPair ? cluster_rank() : 0;

  const int tiles = scheduler.num_tiles();
  constexpr bool kPairedCols = kPairedColumns<M, kFp8>;  // (FP8 kGateUp: n_tiles = I / 64 is even)
  if (wg == 0) {
    setmaxnreg_dec<RegisterSplit<kFp8>::kProducer>();
    // Producer: one thread (on split rings one per ring) issues the TMA loads,
    // tile after tile, in the order the consumers take them. It returns early
    // when a wait gives up or at the fault-injection point (debug_stall_at).
    // kGather: all 128 threads (RowGather), thread 0 also as the TMA producer.
    if (threadIdx.x == 0 || (kSplitRings && threadIdx.x == 32) || kGather != kGatherNone) {
      const int64_t stall_at = p.args.debug_stall_at;
      tma_prefetch_descriptor(&map_a);
      tma_prefetch_descriptor(&map_b);
      // One k-block of `tile` into ring slot `slot`, with its scales when the kernel has a scale ring.
      auto load = [&](const Tile& tile, int kb, int slot) {
        uint64_t* full = &ring.full[slot];
        constexpr int kScaleBytes = !kRing ? 0 : M == GemmMode::kWeightGrad ? kScaleStageBytes : 512;
        // A gathered operand (A, or B: the rest of the stage) comes by the producer threads' cp.async instead.
        constexpr int kGatheredBytes = kGather == kGatherNone ? 0 : kGather == kGatherA ? kTileBytesA : kStage - kTileBytesA;
        mbar_arrive_expect_tx(full, kStage + kScaleBytes - kGatheredBytes);
        uint8_t* stage = smem + slot * kStage;
        load_stage<M, kPair, kBT, kFp8, kWide, kGather>(p, &map_a, &map_b, tile, kb, stage, stage + kTileBytesA, full,
                                                         rank);
        float* dst = scale_ring + slot * (kScaleStageBytes / 4);
        if constexpr (kRing && M == GemmMode::kWeightGrad) {  // this k-block's 128 row and 128 column scales
          const int64_t rb = tile.k_begin / kBlockKFp8 + kb;
          bulk_load(dst, p.args.a_scales + rb * p.args.m + tile.m * kBlockM, 512, full);
          bulk_load(dst + 128, p.args.b_scales + rb * p.args.n + tile.n * kBlockN, 512, full);
        } else if constexpr (kRing) {  // the tile's 128 row scales of k-block kb: a_scales [k / 128, a_rows]
          bulk_load(dst, p.args.a_scales + static_cast<int64_t>(kb) * p.args.a_rows + tile.m * kBlockM, 512, full);
        }
      };
      if constexpr (kSplitRings) {
        // One producer thread per consumer ring (warp r's first lane fills
        // ring r with consumer r's tiles: every other one of the CTA's), so
        // neither ring waits for the other's loads or tile look-ups.
        // debug_stall_at counts ring 0's iterations.
        // kPairedCols: ring r gets tile n = 2j + r of each of the CTA's units (column tile pairs).
        const int r = static_cast<int>(threadIdx.x / 32);
        PipelineState<R> ps;
        const Walk w =
            walk_of(true, kPairedCols, static_cast<int>(blockIdx.x), r, static_cast<int>(gridDim.x), tiles);
        for (int t = w.first; t < w.end; t += w.step) {
          const Tile tile = kPairedCols ? scheduler.pair_tile(t, r) : scheduler.tile(t);
          for (int kb = 0; kb < tile.k_blocks; ++kb, ++ps) {
            if (r == 0 && static_cast<int64_t>(ps.it) == stall_at) return;
            if (!waits.wait(&ring.empty[r * R + ps.stage()], ps.empty_parity(), kBarrierEmpty, ps.it)) return;
            load(tile, kb, r * R + ps.stage());
          }
        }
        return;
      }
      if constexpr (kGather != kGatherNone) {
        // All 128 threads gather (RowGather); thread 0 also arms each stage's
        // full barrier and loads the other operand by TMA. Each thread's
        // copies of a stage arrive on its full barrier when they have landed
        // (cp.async.mbarrier.arrive.noinc: 1 + 128 arrivals), so nothing
        // here waits for them; the consumers' proxy fence after the full
        // wait orders these generic-proxy writes before their wgmma reads.
        // A warp's lane 0 waits for free slots for the warp, so that the warp
        // leaves together. The stages' and barriers' shared-window addresses
        // stay in registers (StageRingAt).
        const int lane = static_cast<int>(threadIdx.x & 31), chunk = lane & 7;
        const StageRingAt at = StageRingAt::of(ring);
        const uint32_t gathered0 = smem_u32(smem) + (kGather == kGatherA ? 0 : kTileBytesA);
        using Gathering = RowGather<M, kWide && kGather == kGatherB ? 4 : 2>;
        constexpr int kRows = Gathering::kRows;
        Gathering g;
        g.pitch16 = static_cast<uint32_t>((kGather == kGatherA ? p.args.a_cols : p.args.b_cols) / 8);
        g.top_k = RouteDivisor::of(static_cast<uint32_t>(p.args.plan.top_k));
        g.dst = Gathering::lane_row() * 128 + ((chunk ^ (Gathering::lane_row() & 7)) << 4);
        const char* token_rows = static_cast<const char*>(kGather == kGatherA ? p.args.a : p.args.b) + chunk * 16;
        State ps;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
          const Tile tile = scheduler.tile(t);
          if (tile.k_blocks == 0) continue;
          // kWeightGrad: the tile's 128 columns of the token rows.
          g.rows = token_rows + (M == GemmMode::kWeightGrad
                                     ? (kGather == kGatherA ? tile.m * kBlockN : tile.n * (kWide ? 256 : kBlockN)) * 2
                                     : 0);
          // M-grouped: this thread's rows of the tile, for all its k-blocks. kWeightGrad:
          // K is pool rows, so each k-block has its own, looked up a k-block ahead.
          const int64_t first_row =
              M == GemmMode::kWeightGrad ? tile.k_begin : static_cast<int64_t>(tile.m) * kBlockM;
          uint32_t off[kRows], next_off[kRows];
          uint32_t valid = g.look_up_all(p, first_row, off), next_valid = valid;
          for (int kb = 0; kb < tile.k_blocks; ++kb, ++ps) {
            if constexpr (M == GemmMode::kWeightGrad)
              if (kb + 1 < tile.k_blocks) next_valid = g.look_up_all(p, first_row + (kb + 1) * kBlockK, next_off);
            if (static_cast<int64_t>(ps.it) == stall_at) return;
            if (!__shfl_sync(0xffffffffu, lane == 0 ? at.wait_empty(waits, ps) : false, 0)) {
              cp_async_wait_all();  // no copy may land after the CTA has gone
              return;
            }
            if (threadIdx.x == 0) load(tile, kb, ps.stage());
            g.copy(gathered0 + static_cast<uint32_t>(ps.stage() * kStage), kb, off, valid);
            cp_async_arrive_noinc(at.full_at(ps.stage()));
            if constexpr (M == GemmMode::kWeightGrad) {
#pragma unroll
              for (int i = 0; i < kRows; ++i) off[i] = next_off[i];
              valid = next_valid;
            }
          }
        }
        if constexpr (kPair)  // stay until both CTAs have released every stage (below)
          if (threadIdx.x == 0)
            for (int s = 0; s < S; ++s, ++ps)
              if (!ring.wait_empty(waits, ps)) return;
        return;
      }
      State ps;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const Tile tile = scheduler.tile(t);
        if constexpr (kHoldRows)
          if (!scheduler.wait_rows_in(waits, tile)) return;
        for (int kb = 0; kb < tile.k_blocks; ++kb, ++ps) {
          if (static_cast<int64_t>(ps.it) == stall_at) return;
          if (!ring.wait_empty(waits, ps)) return;
          load(tile, kb, ps.stage());
        }
      }
      // Stay until both CTAs' consumers have released every stage: the
      // peer's last arrivals land in this CTA's shared memory.
      if constexpr (kPair)
        for (int s = 0; s < S; ++s, ++ps)
          if (!ring.wait_empty(waits, ps)) return;
    }
    // Warps 1-3 (idle in these kernels): the side jobs, if any (side_jobs.cuh).
    // bf16 without gathers; the combine in kWeightGrad only (in kDownGrad's
    // kernels its registers made ptxas spill), the gather in every mode but
    // kDown (kGateUp and kDownGrad: their own A, the tiles held on its counts).
    // (Not on split rings, kFp8, where thread 32 is a producer: the side jobs' ballots need whole warps.)
    if constexpr (!kFp8 && kGather == kGatherNone && M != GemmMode::kDown) {
      if (threadIdx.x >= 32) {
        if (p.args.side_gather.pool != nullptr)
          run_side_gather(p.args.side_gather);
        if constexpr (M == GemmMode::kWeightGrad)
          if (p.args.side_combine.out != nullptr)
            run_side_combine(p.args.side_combine, p.args.errors);
      }
    }
    return;
  }

  // Consumers: warpgroup wg takes the CTA's tiles j with j % 2 == wg - 1 and
  // computes all 128 rows of each (acc[h]: rows [64h, 64h + 64)). On one
  // shared ring both walk every tile to keep the pipeline state in step with
  // the producer, and main loops run in tile order, one consumer at a time
  // (OrderBarriers); on split rings each walks its own tiles and ring (FP8
  // kGateUp: consumer c takes column tile 2j + c of each unit, kPairedCols). kWide:
  // both take every tile, at once, consumer c its rows [64c, 64c + 64) (acc[h]
  // the tile's columns [128h, 128h + 128): kGateUp's gate and up columns); no
  // order barriers (each stage is freed by both, so neither can poll a
  // stage's next phase early).
  setmaxnreg_inc<RegisterSplit<kFp8>::kConsumer>();
  const int cw = wg - 1;
  const bool warp_leader = (threadIdx.x & 31) == 0;
  const int my_first = kSplitRings ? cw * R : 0;  // this consumer's first slot
  const StageRing<R> my_ring{ring.full + my_first, ring.empty + my_first};
  const uint8_t* my_stages = smem + my_first * kStage;
  const float* my_scales = scale_ring + my_first * (kScaleStageBytes / 4);
  // A warp (every lane with kLaneRelease) gives stage s of its ring back to
  // this CTA's producer and, in a pair, to the peer's.
  auto release = [&](int s) {
    if (!kLaneRelease && !warp_leader) return;
    mbar_arrive(&my_ring.empty[s]);
    if constexpr (kPair) mbar_arrive_cluster(&my_ring.empty[s], rank ^ 1u);
  };
  uint8_t* my_buffer = epilogue_base + cw * kEpilogueBytes;
  EpilogueContext ctx{reinterpret_cast<__nv_bfloat16*>(my_buffer),
                      row_dst_base + cw * kRowRows,
                      row_w_base + cw * kRowRows,
                      my_buffer,
                      &z_full[cw],
                      0,
                      -1,
                      &waits,
                      &map_z,
                      {&map_out0, &map_out1}};
  // kDownGrad: the first z chunk of this consumer's first tile loads during its main loop.
  const bool epilogues = !p.args.debug_skip_epilogue;
  if constexpr (Tr::kZChunks) {
    const int first = blockIdx.x + (kWide ? 0 : cw * static_cast<int>(gridDim.x));
    if (epilogues && first < tiles && (threadIdx.x & 127) == 0)
      load_z_chunk(p, ctx, z_piece<kWide>(scheduler.tile(first), 0, cw));
  }
  PipelineState<R> ps;
  float acc[2][64];
  int j = 0, mine = 0;  // mine: tiles this consumer has taken
  // kPairedCols: t walks the CTA's units (column tile pairs), this consumer tile n = 2j + cw of each.
  const Walk walk =
      walk_of(kSplitRings, kPairedCols, static_cast<int>(blockIdx.x), cw, static_cast<int>(gridDim.x), tiles);
  for (int t = walk.first; t < walk.end; t += walk.step, ++j) {
    const Tile tile = kPairedCols ? scheduler.pair_tile(t, cw) : scheduler.tile(t);
    if constexpr (!kSplitRings && !kWide) {
      if ((j & 1) != cw) {
        ps.advance(tile.k_blocks);
        continue;
      }
      if (!order.wait_turn(waits, cw, mine, ps.it)) {
        bulk_wait_group<0>();  // the previous epilogue's stores still read shared memory
        return;
      }
    }
    ++mine;
    // The slot modes' row source (EpilogueContext::my_src): this thread's tile row's.
    // (kWide: the consumer's 64 rows; threads 64-127 load them again.)
    auto row_source = [&] {
      const int r = kWide ? 64 * cw + (threadIdx.x & 63) : (threadIdx.x & 127);
      return p.args.plan.row_src[static_cast<int64_t>(tile.m) * kBlockM + r];
    };
    // Read before the main loop, so that the epilogue does not start by waiting for it.
    if constexpr (Tr::kRowDstBytes > 0 && !kHoldRows)
      if (epilogues) ctx.my_src = row_source();
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    if constexpr (kFp8) {
      if (!fp8_main_loop<M, kBT, kARing>(p, tile, my_stages, my_scales, my_ring, waits, ps, acc, release)) {
        bulk_wait_group<0>();
        return;
      }
    } else {
      for (int kb = 0; kb < tile.k_blocks; ++kb, ++ps) {
        if (!my_ring.wait_full(waits, ps)) {
          wgmma_wait<0>();  // retire the previous k-block's group before leaving
          bulk_wait_group<0>();  // and the previous epilogue's stores (they read shared memory)
          return;
        }
        // Gathered rows came by cp.async (generic proxy); wgmma reads through
        // the async proxy. (Leaving this fence out changed nothing measurable:
        // session 34.)
        if constexpr (kGather != kGatherNone) fence_proxy_async_shared();
        const uint8_t* sa = my_stages + ps.stage() * kStage;
        const uint8_t* sb = sa + kTileBytesA;
        // Between here and the wait<0> after the loop, nothing but wgmma touches
        // the accumulators (the fences are compiler-only: no instruction).
        fence_accumulators(acc[0]);
        fence_accumulators(acc[1]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kWide && kk < kBlockK / 16; ++kk) {  // this consumer's A box, B's 256 rows at once
          // MN-major operands (kWeightGrad's A and B, kGateUpGrad's B): a k16
          // step is 16 box rows; B's four 64-column boxes are kBoxBytes apart.
          const uint64_t da = Tr::kAMnMajor ? smem_desc_sw128(sa + cw * kBoxBytes + kk * 16 * 128, kBoxBytes, 1024)
                                            : smem_desc_sw128(sa + cw * kBoxBytes + kk * 32, 0, 1024);
          const uint64_t db =
              kBMn ? smem_desc_sw128(sb + kk * 16 * 128, kBoxBytes, 1024) : smem_desc_sw128(sb + kk * 32, 0, 1024);
          wgmma_m64n256k16_bf16<Tr::kAMnMajor ? 1 : 0, kBMn ? 1 : 0>(acc[0], acc[1], da, db, 1);
        }
#pragma unroll
        for (int kk = 0; !kWide && kk < kBlockK / 16; ++kk) {
          uint64_t db;
          if constexpr (kBMn) {
            db = smem_desc_sw128(sb + kk * 16 * 128, kBoxBytes, 1024);
          } else {
            db = smem_desc_sw128(sb + kk * 32, 0, 1024);
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // A box h holds tile rows [64h, 64h + 64)
            uint64_t da;
            if constexpr (Tr::kAMnMajor) {
              da = smem_desc_sw128(sa + h * kBoxBytes + kk * 16 * 128, kBoxBytes, 1024);
            } else {
              da = smem_desc_sw128(sa + h * kBoxBytes + kk * 32, 0, 1024);
            }
            wgmma_m64n128k16_bf16<Tr::kAMnMajor ? 1 : 0, kBMn ? 1 : 0>(acc[h], da, db, 1);
          }
        }
        wgmma_commit();
        // Keep this k-block's group in flight while the next one is waited for
        // and issued: retiring down to one pending group proves the previous
        // k-block's group done, so its stage (not this one) goes back.
        wgmma_wait<1>();
        if (kb > 0) release(ps.previous_stage());
      }
      wgmma_wait<0>();
      fence_accumulators(acc[0]);
      fence_accumulators(acc[1]);
      if (tile.k_blocks > 0) release(ps.previous_stage());
    }
    if (!kSplitRings && !kWide && (threadIdx.x & 127) == 0) order.pass_turn(cw);  // the other consumer may start its main loop
    if (!epilogues) continue;
    // kHoldRows: the tile's rows, and so their sources, are in once its main loop has run.
    if constexpr (Tr::kRowDstBytes > 0 && kHoldRows) ctx.my_src = row_source();
    bool stored;
    if constexpr (kWide && M == GemmMode::kGateUp) {
      stored = WideGateUpEpilogue{}(p, tile, acc, ctx, cw);
    } else if constexpr (kWide && M == GemmMode::kWeightGrad) {
      stored = WeightGradEpilogue<true>{}(p, tile, acc, cw);
    } else if constexpr (kWide && M == GemmMode::kDownGrad) {
      stored = DownGradEpilogue<true>{}(p, tile, acc, ctx, cw);
    } else if constexpr (kWide && M == GemmMode::kDown) {
      stored = p.args.down_to_pool ? WidePoolDownEpilogue{}(p, tile, acc, ctx, cw) : WideSlotEpilogue<M>{}(p, tile, acc, ctx);
    } else if constexpr (kWide) {
      stored = WideSlotEpilogue<M>{}(p, tile, acc, ctx);
    } else {
      stored = Epilogue<M, kFp8>{}(p, tile, acc, ctx);  // FP8: the staged modes' plain stores (store_rows)
    }
    if (!stored) {
      bulk_wait_group<0>();
      return;
    }
    // kDownGrad: the buffer is free again (the storer, this same thread, saw
    // the last TMA store read it); the next tile's first z chunk loads now.
    if constexpr (Tr::kZChunks) {
      const int next = t + (kWide ? 1 : 2) * static_cast<int>(gridDim.x);
      if (next < tiles && (threadIdx.x & 127) == 0) load_z_chunk(p, ctx, z_piece<kWide>(scheduler.tile(next), 0, cw));
    }
  }
  // The epilogues' bulk and TMA stores still read shared memory; let them land before the kernel ends.
  if constexpr (Tr::kZChunks || Tr::kStaged) bulk_wait_group<0>();
}

template <GemmMode M, bool kPair, bool kHoldRows, bool kBT = false, bool kFp8 = false, bool kARing = false,
          bool kWide = false, int kGather = kGatherNone>
Status launch_mode(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_z,
                   const CUtensorMap& map_out0, const CUtensorMap& map_out1, const KernelParams& params, int num_sms,
                   cudaStream_t stream) {
  auto* kernel = grouped_gemm_kernel<M, kPair, kHoldRows, kBT, kFp8, kARing, kWide, kGather>;
  // The register split (engine_config.cuh) shares out a pool of kLaunchRegs per
  // thread; a kernel built with fewer would block in setmaxnreg for good.
  // Asked once per kernel (a failed query is asked again next time).
  static std::atomic<int> known_regs{0};
  int launch_regs = known_regs.load(std::memory_order_relaxed);
  if (launch_regs == 0) {
    cudaFuncAttributes a{};
    const cudaError_t q = cudaFuncGetAttributes(&a, kernel);
    if (q != cudaSuccess) return cuda_status("grouped GEMM: reading the kernel's attributes", q);
    launch_regs = a.numRegs;
    known_regs.store(launch_regs, std::memory_order_relaxed);
  }
  if (launch_regs != kLaunchRegs)
    return internal_error("grouped GEMM: the kernel has " + std::to_string(launch_regs) +
                          " registers per thread; its register split needs " + std::to_string(kLaunchRegs));
  constexpr int kSmem = kWide ? kSmemBytesWide<M> : kSmemBytes<M, kFp8, has_scale_ring<M, kFp8, kARing>>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return cuda_status("grouped GEMM: setting its shared memory", err);
  // The smallest shared-memory carve-out that holds it (with the driver's 1 KB
  // a block): the rest of the SM's 256 KB is L1 (the M-grouped FP8 kernels'
  // 164-198 KB get the 196 KB carve-out, 60 KB of L1). The hint is a
  // percentage of the 228 KB maximum, which the driver rounds up to a
  // supported size, so it is given rounded down (196 KB: 85%). Only a hint:
  // a failure to set it is cleared and ignored.
  constexpr int kCarveoutPercent = carveout_percent(kSmem + 1024);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, kCarveoutPercent) != cudaSuccess)
    (void)cudaGetLastError();
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(num_sms);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = stream;
  cudaLaunchAttribute cluster{};
  if constexpr (kPair) {
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 2, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
    cfg.attrs = &cluster;
    cfg.numAttrs = 1;
    // A persistent grid must fit at once: as many pairs as the GPU can hold
    // side by side (a GPC with an odd SM count leaves one SM out). Asked once.
    static std::atomic<int> known_pairs{0};
    int pairs = known_pairs.load(std::memory_order_relaxed);
    if (pairs == 0) {
      cfg.gridDim = dim3(num_sms / 2 * 2);  // the query refuses a grid that is not whole clusters
      err = cudaOccupancyMaxActiveClusters(&pairs, kernel, &cfg);
      if (err != cudaSuccess) return cuda_status("grouped GEMM: how many CTA pairs fit", err);
      if (pairs <= 0) return internal_error("grouped GEMM: no pair of CTAs fits on this GPU");
      known_pairs.store(pairs, std::memory_order_relaxed);
    }
    cfg.gridDim = dim3(2 * std::min(pairs, num_sms / 2));
  }
  cudaLaunchAttribute cooperative{};
  if (!kPair && params.args.side_gather.rows_ready != nullptr) {
    // Tiles wait for rows that the grid's own warps gather (kGateUp's or
    // kDownGrad's side gather of its A): every CTA must run at once, also beside other streams' kernels
    // (a cooperative launch; one that cannot fit fails instead of waiting).
    cooperative.id = cudaLaunchAttributeCooperative;
    cooperative.val.cooperative = 1;
    cfg.attrs = &cooperative;
    cfg.numAttrs = 1;
  }
  err = cudaLaunchKernelEx(&cfg, kernel, map_a, map_b, map_z, map_out0, map_out1, params);
  if (err == cudaErrorCooperativeLaunchTooLarge) {  // a configuration error: nothing launched, nothing sticky
    (void)cudaGetLastError();
    return unavailable("grouped GEMM: a side gather's held tiles need all " + std::to_string(cfg.gridDim.x) +
                       " CTAs resident at once, and this GPU (or its MPS share) cannot hold them");
  }
  return cuda_status("grouped GEMM launch", err);
}

}  // namespace

Status launch_grouped_gemm(const GroupedGemmArgs& args, int num_sms, cudaStream_t stream) {
  using Gather = GroupedGemmArgs::Gather;
  if (args.gather != Gather::kNone) {
    if (args.fp8 || args.rows_ready != nullptr)
      return invalid_argument("grouped GEMM: gathered rows are for bf16 without rows_ready");
    const bool mode_ok = args.gather == Gather::kA
                             ? args.mode == GemmMode::kGateUp || args.mode == GemmMode::kWeightGrad ||
                                   (args.mode == GemmMode::kDownGrad && !args.b_k_major)
                             : args.mode == GemmMode::kWeightGrad;
    if (!mode_ok)
      return invalid_argument("grouped GEMM: gathered rows are kGateUp's, kDownGrad's (B as given) and kWeightGrad's A, "
                              "and kWeightGrad's B");
    if (args.plan.row_src == nullptr || args.plan.top_k <= 0 || args.gather_tokens <= 0 ||
        args.gather_tokens > INT32_MAX - 1)
      return invalid_argument("grouped GEMM: gathered rows need the plan's row_src and top_k, and 1 to 2^31 - 2 token "
                              "rows (gather_tokens)");
    // Every token the plan routes must be a row of the matrix (the producers' offsets are not bounds-checked).
    if (args.gather_tokens < args.plan.num_tokens)
      return invalid_argument("grouped GEMM: gathered rows: the token matrix has " + std::to_string(args.gather_tokens) +
                              " rows, fewer than the plan's " + std::to_string(args.plan.num_tokens) + " tokens");
    // The copies read the columns the GEMM uses (M-grouped: K; kWeightGrad: A's m or B's n) with no bounds
    // check, where TMA would fill zeros past the matrix's end.
    const int64_t cols = args.gather == Gather::kA ? args.a_cols : args.b_cols;
    const int64_t used = args.mode != GemmMode::kWeightGrad ? args.k : args.gather == Gather::kA ? args.m : args.n;
    if (used > cols)
      return invalid_argument("grouped GEMM: gathered rows: the GEMM reads " + std::to_string(used) +
                              " columns of the token matrix, which has " + std::to_string(cols));
    // The producers address token rows by 32-bit offsets in 16-byte units (RowGather).
    const int64_t row_bytes = cols * 2;
    if (args.gather_tokens * (row_bytes / 16) > int64_t{UINT32_MAX})
      return invalid_argument("grouped GEMM: the gathered token matrix is over 64 GiB (" +
                              std::to_string(args.gather_tokens) + " rows of " + std::to_string(row_bytes) +
                              " bytes); gathered rows need less");
  }
  if (args.n % kBlockN != 0 && args.mode != GemmMode::kGateUp)
    return internal_error("grouped GEMM: N = " + std::to_string(args.n) + " is not a multiple of 128");
  if (args.k % kBlockK != 0) return internal_error("grouped GEMM: K is not a multiple of 64");
  if (args.rows_ready != nullptr && args.mode == GemmMode::kWeightGrad)
    return internal_error("grouped GEMM: rows_ready holds pool tiles of the M-grouped modes, not kWeightGrad");
  if (args.side_combine.out != nullptr) {
    const GroupedGemmArgs::SideCombine& s = args.side_combine;
    if (args.mode != GemmMode::kWeightGrad || args.fp8 || args.gather != Gather::kNone)
      return invalid_argument("grouped GEMM: side_combine runs in the bf16 kWeightGrad kernels that do not gather rows");
    if (s.slots == nullptr || s.topk_idx == nullptr || s.error_key == nullptr || s.begin < 0 || s.begin > s.end ||
        s.end > s.tokens || s.slot_tokens < s.tokens || s.top_k < 1 || s.top_k > 32 || s.num_experts < 1 ||
        s.hidden <= 0 || s.hidden % 8 != 0 || s.hidden / 8 > INT32_MAX)
      return invalid_argument("grouped GEMM: side_combine needs slots, topk_idx and error_key, 0 <= begin <= end <= "
                              "tokens <= slot_tokens, top_k 1..32, num_experts >= 1 and hidden a positive multiple "
                              "of 8");
  }
  if (args.side_gather.pool == nullptr && args.side_gather.rows_ready != nullptr)
    return invalid_argument("grouped GEMM: side_gather.rows_ready without a side gather (pool is null)");
  if (args.side_gather.pool != nullptr) {
    const GroupedGemmArgs::SideGather& s = args.side_gather;
    if (args.mode == GemmMode::kDown || args.fp8 || args.gather != Gather::kNone)
      return invalid_argument("grouped GEMM: side_gather runs in the bf16 kGateUp, kDownGrad, kGateUpGrad and "
                              "kWeightGrad kernels that do not gather rows");
    // kGateUp and kDownGrad gather their own A: their tiles must hold on the gather's counts (and nothing else
    // gathers a GEMM's operand).
    const bool own_a = args.mode == GemmMode::kGateUp || args.mode == GemmMode::kDownGrad;
    if (own_a != (s.rows_ready != nullptr) ||
        (own_a && (s.pool != args.a || args.rows_ready != s.rows_ready || args.ready_value != 128 ||
                   args.peer_slots.rank_buffers != nullptr || s.pool_rows != args.plan.pool_rows ||
                   s.row_src != args.plan.row_src || s.top_k != args.plan.top_k || s.width != args.a_cols)))
      return invalid_argument("grouped GEMM: side_gather in kGateUp and kDownGrad fills their A (pool == a, the "
                              "plan's rows, width a_cols) and counts its rows into rows_ready, which the kernel holds "
                              "its tiles on (rows_ready the same, ready_value 128); elsewhere it has no rows_ready");
    if ((s.src == nullptr && s.source_buffers == nullptr) || s.row_src == nullptr || s.pool_rows == nullptr ||
        s.top_k < 1 || s.width <= 0 || s.width % 8 != 0 || s.width / 8 > INT32_MAX)
      return invalid_argument("grouped GEMM: side_gather needs src (or source_buffers), row_src and pool_rows, "
                              "top_k >= 1 and width a positive multiple of 8");
    if (s.source_buffers != nullptr &&
        (s.tokens_per_source < 1 || s.sources < 1 || s.sources > 32 || s.route_row != nullptr ||
         s.source_offset % 16 != 0 || static_cast<int64_t>(s.sources) * s.tokens_per_source < args.plan.num_tokens))
      return invalid_argument("grouped GEMM: side_gather from source_buffers needs tokens_per_source >= 1, 1 to 32 "
                              "sources holding the plan's tokens, a 16-byte aligned source_offset, and the gather "
                              "form (no route_row)");
    if (s.route_row != nullptr && (s.rows_ready != nullptr || s.top_k > kMaxTopK || s.tokens < 0 ||
                                   s.tokens * s.top_k > INT32_MAX))
      return invalid_argument("grouped GEMM: side_gather as a scatter (route_row) has no rows_ready (its rows come in "
                              "token order), top_k <= 32 and tokens * top_k within int32");
  }
  // rows_first reorders the M-grouped modes' tiles (held ones too: an expert's tiles still come in pool order).
  if (args.rows_first && args.mode == GemmMode::kWeightGrad)
    return invalid_argument("grouped GEMM: rows_first orders the M-grouped modes' tiles, not kWeightGrad's");
  if (args.mode == GemmMode::kWeightGrad && reinterpret_cast<uintptr_t>(args.out0) % (args.out_f32 ? 16 : 8) != 0)
    return internal_error("grouped GEMM: kWeightGrad's output must be 16-byte (fp32) or 8-byte (bf16) aligned (4-column "
                          "stores)");
  if (args.b_k_major && args.mode != GemmMode::kDownGrad && args.mode != GemmMode::kGateUpGrad)
    return internal_error("grouped GEMM: b_k_major is for kDownGrad and kGateUpGrad (the others read K-major B already, "
                          "or both operands MN-major)");
  if (args.b_k_major && args.rows_ready != nullptr)
    return unimplemented("grouped GEMM: b_k_major with rows_ready is not instantiated");
  if (args.b_k_major && (args.b_cols != args.k || args.n <= 0 || args.b_rows % args.n != 0))
    return internal_error("grouped GEMM: b_k_major expects B as [E * n, k]");
  if (args.rows_ready != nullptr && args.ready_value == 0)
    return internal_error("grouped GEMM: rows_ready with ready_value 0 would wait for nothing");
  if (args.peer_slots.rank_buffers != nullptr) {
    const GroupedGemmArgs::PeerSlots& ps = args.peer_slots;
    if (args.mode != GemmMode::kDown && args.mode != GemmMode::kGateUpGrad)
      return internal_error("grouped GEMM: peer_slots are for the slot-writing modes (kDown, kGateUpGrad)");
    if (ps.source_counts == nullptr)
      return internal_error("grouped GEMM: peer_slots need the sources' token counts");
    if (args.plan.num_tokens == 0) {
      // No virtual tokens (every rank's max_tokens is 0): no tile, nothing to address.
    } else if (ps.tokens_per_rank <= 0 || args.plan.num_tokens % ps.tokens_per_rank != 0 ||
               args.plan.num_tokens / ps.tokens_per_rank > 8)
      return internal_error("grouped GEMM: peer_slots.tokens_per_rank must split the plan's virtual tokens into 1 to 8 "
                            "ranks");
    if (ps.offset % 16 != 0 || (args.n * 2) % 16 != 0)
      return internal_error("grouped GEMM: peer slot rows must be 16-byte aligned (16-byte stores)");
  }
  if (args.fp8) {
    if ((args.mode == GemmMode::kDownGrad || args.mode == GemmMode::kGateUpGrad) && !args.b_k_major)
      return invalid_argument("grouped GEMM: FP8 kDownGrad / kGateUpGrad read B K-major: set b_k_major (the block "
                              "quantizer's transposed copy) with b_scales [E, k / 128, n / 128]");
    if (args.rows_ready != nullptr) return unimplemented("grouped GEMM: FP8 with rows_ready is not instantiated");
    if (args.k % kBlockKFp8 != 0) return internal_error("grouped GEMM: FP8 needs K a multiple of 128");
    if (args.mode == GemmMode::kGateUp && (args.intermediate % 128 != 0 || args.n != args.intermediate))
      return internal_error("grouped GEMM: FP8 kGateUp needs I a multiple of 128 and n = I, the a columns (gate and up "
                            "in whole scale blocks; its consumers take column tiles in pairs)");
    if (args.a_scales == nullptr || args.b_scales == nullptr)
      return internal_error("grouped GEMM: FP8 needs a_scales and b_scales");
    if (args.b_rows % 128 != 0) return internal_error("grouped GEMM: FP8's B rows must be whole 128-row scale blocks");
    if (args.mode == GemmMode::kWeightGrad && (args.m % 128 != 0 || args.a_cols % 128 != 0))
      return internal_error("grouped GEMM: FP8 kWeightGrad needs m and the pool rows to be whole 128-row blocks");
    if (args.mode != GemmMode::kWeightGrad && (args.a_cols != args.k || (!args.b_k_major && args.b_cols != args.k)))
      return internal_error("grouped GEMM: FP8's A (and a K-major B) must have k columns (their scales are k / 128 wide)");
    if (args.mode == GemmMode::kWeightGrad && (args.a_rows != args.m || args.b_rows != args.n || args.a_cols != args.b_cols))
      return invalid_argument("grouped GEMM: FP8 kWeightGrad reads A^T [m, C] and B^T [n, C] (quantize_e4m3_cols_t's "
                              "q_t), with scales [C / 128, m] and [C / 128, n]");
    if (args.mode == GemmMode::kWeightGrad &&
        (reinterpret_cast<uintptr_t>(args.a_scales) % 16 != 0 || reinterpret_cast<uintptr_t>(args.b_scales) % 16 != 0))
      return invalid_argument("grouped GEMM: FP8 kWeightGrad's scales must be 16-byte aligned (bulk copies)");
    if (args.a_scales_by_k_block &&
        (args.mode == GemmMode::kWeightGrad || args.a_rows % 4 != 0 || reinterpret_cast<uintptr_t>(args.a_scales) % 16 != 0))
      return invalid_argument("grouped GEMM: a_scales_by_k_block is for the M-grouped FP8 modes, with a_rows a multiple "
                              "of 4 and a_scales 16-byte aligned (each k-block's run is a bulk copy)");
  }
  if (args.a_scales_by_k_block && !args.fp8)
    return invalid_argument("grouped GEMM: a_scales_by_k_block is for FP8");
  if (args.dz_q != nullptr &&
      (args.mode != GemmMode::kDownGrad || args.intermediate % 128 != 0 || args.n != args.intermediate ||
       args.dz_s == nullptr ||
       reinterpret_cast<uintptr_t>(args.dz_q) % 8 != 0 || reinterpret_cast<uintptr_t>(args.dz_s) % 4 != 0))
    return invalid_argument("grouped GEMM: dz_q (dz in e4m3 from the epilogue) is for kDownGrad with I a multiple of "
                            "128, dz_s given, dz_q 8-byte and dz_s 4-byte aligned");
  KernelParams p;
  p.args = args;
  // bf16 kGateUp and kDown in 128 x 256 tiles (the kernel's kWide) wherever
  // they apply: kGateUp with whole 128-column blocks of gate and of up (I %
  // 128 == 0), kDown with N % 256 == 0 writing this GPU's slots (not peer
  // slots); no row holds (expert parallelism's owners keep the 128 x 128
  // tiles); unless a test asks for the narrow ones. kGateUpGrad (B as given,
  // this GPU's slots) and kWeightGrad with N % 256 == 0, rows not gathered
  // (kWeightGrad: or gathered, A's 128 columns or B's 256);
  // kDownGrad (B as given, N % 256 == 0, rows pooled or A gathered) when
  // asked for (wide_down_grad).
  const bool wide_down_grad = args.wide_down_grad && args.mode == GemmMode::kDownGrad && !args.b_k_major &&
                              args.n % 256 == 0 && args.gather != Gather::kB;
  const bool wide_bwd =
      (args.gather == Gather::kNone || args.mode == GemmMode::kWeightGrad) && !args.b_k_major && args.n % 256 == 0 &&
                        ((args.mode == GemmMode::kGateUpGrad && args.peer_slots.rank_buffers == nullptr) ||
                         args.mode == GemmMode::kWeightGrad);
  // (kGateUp gathering its own A, side_gather: wide with row holds.)
  const bool holds_own_rows = args.mode == GemmMode::kGateUp && args.side_gather.rows_ready != nullptr;
  const bool wide = !args.fp8 && (args.rows_ready == nullptr || holds_own_rows) && !args.narrow_tiles &&
                    ((args.mode == GemmMode::kGateUp && args.intermediate % 128 == 0 && args.n % 128 == 0) ||
                     (args.mode == GemmMode::kDown && args.n % 256 == 0 && args.peer_slots.rank_buffers == nullptr) ||
                     wide_bwd || wide_down_grad);
  if (args.down_to_pool && !(wide && args.mode == GemmMode::kDown && args.out0 != nullptr))
    return invalid_argument(
        "grouped GEMM: down_to_pool is for bf16 kDown in 128 x 256 tiles (n a multiple of 256, no peer_slots, "
        "rows_ready or narrow_tiles) into out0");
  // kGateUp: each 128-column tile holds 64 gate and the matching 64 up columns
  // (wide: each 256-column tile 128 and 128).
  p.n_tiles = static_cast<int>(args.mode == GemmMode::kGateUp ? args.n / (wide ? 128 : 64)
                                                             : args.n / (wide ? 256 : kBlockN));
  p.m_tiles = static_cast<int>(args.m / kBlockM);
  p.k_blocks = static_cast<int>(args.k / (args.fp8 ? kBlockKFp8 : kBlockK));
  // Every operand is loaded as 64 x 64 boxes; the mode decides what the two
  // box dimensions mean (K-major: rows x K, MN-major: K x MN).
  CUtensorMap map_a, map_b;
  if (args.fp8) {  // e4m3: boxes of 64 rows x 128 elements, the same 128-byte rows
    MEGAMOE_RETURN_IF_ERROR(make_tma_2d_e4m3_box64x128(args.a, args.a_rows, args.a_cols, &map_a));
    MEGAMOE_RETURN_IF_ERROR(make_tma_2d_e4m3_box64x128(args.b, args.b_rows, args.b_cols, &map_b));
  } else {
    // A gathered operand: its map (of the token rows) is never loaded from, the producer threads copy it.
    MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(
        args.a, args.gather == Gather::kA ? args.gather_tokens : args.a_rows, args.a_cols, &map_a));
    MEGAMOE_RETURN_IF_ERROR(
        make_tma_2d_bf16_box64(args.b, args.gather == Gather::kB ? args.gather_tokens : args.b_rows, args.b_cols, &map_b));
  }
  // kDownGrad reads the saved z pool [C, 2I] and writes dz [C, 2I] and wa
  // [C, I] by TMA; wide kGateUp writes z [C, 2I] and a [C, I] by TMA (each
  // when asked for); kDown with down_to_pool its rows [C, n]. The other modes
  // never touch these three maps.
  CUtensorMap map_z = map_a, map_out0 = map_a, map_out1 = map_a;
  if (args.down_to_pool) MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(args.out0, args.a_rows, args.n, &map_out0));
  if (args.mode == GemmMode::kDownGrad || (wide && args.mode == GemmMode::kGateUp)) {
    const int64_t I = args.intermediate;
    if (args.mode == GemmMode::kDownGrad)
      MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(args.z_pool, args.a_rows, 2 * I, &map_z));
    if (args.out0 != nullptr) MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(args.out0, args.a_rows, 2 * I, &map_out0));
    if (args.out1 != nullptr) MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(args.out1, args.a_rows, I, &map_out1));
  }
  // Pairs of CTAs share A (in the modes where that is faster: ModeTraits::kPairs)
  // when every tile has a partner with the same rows: tiles 2i and 2i + 1 are
  // n and n + 1 of one row tile, so n_tiles must be even.
  const bool pair = args.pair_ctas && p.n_tiles % 2 == 0 && num_sms >= 2;
  auto launch = [&](auto mode) {
    constexpr GemmMode m = decltype(mode)::value;
    // Gathered rows (bf16; the modes checked above): A in kGateUp, kDownGrad and kWeightGrad, B in
    // kWeightGrad; the wide tiles where they apply, else kWeightGrad's B in pairs, else one CTA a tile.
    auto gathering = [&](auto pair_ctas, auto wide_tiles, auto operand) {
      return launch_mode<m, decltype(pair_ctas)::value, false, false, false, false, decltype(wide_tiles)::value,
                         decltype(operand)::value>(map_a, map_b, map_z, map_out0, map_out1, p, num_sms, stream);
    };
    using Yes = std::true_type;
    using No = std::false_type;
    if constexpr (m == GemmMode::kGateUp || m == GemmMode::kDownGrad || m == GemmMode::kWeightGrad) {
      using A = std::integral_constant<int, kGatherA>;
      if (args.gather == Gather::kA) return wide ? gathering(No{}, Yes{}, A{}) : gathering(No{}, No{}, A{});
    }
    if constexpr (m == GemmMode::kWeightGrad) {
      using B = std::integral_constant<int, kGatherB>;
      if (args.gather == Gather::kB)
        return wide ? gathering(No{}, Yes{}, B{}) : pair ? gathering(Yes{}, No{}, B{}) : gathering(No{}, No{}, B{});
    }
    if constexpr (m == GemmMode::kGateUp || m == GemmMode::kDown) {
      if (args.fp8 && args.a_scales_by_k_block)
        return launch_mode<m, false, false, false, true, true>(map_a, map_b, map_z, map_out0, map_out1, p, num_sms, stream);
      if (args.fp8) return launch_mode<m, false, false, false, true>(map_a, map_b, map_z, map_out0, map_out1, p, num_sms, stream);
    }
    // wide: never with FP8, B K-major; row holds only in kGateUp gathering its own A (side_gather);
    // its gathering kernels launched above
    if constexpr (m == GemmMode::kGateUp)
      if (wide && args.rows_ready != nullptr)
        return launch_mode<m, false, true, false, false, false, true>(map_a, map_b, map_z, map_out0, map_out1, p,
                                                                      num_sms, stream);
    if (wide)
      return launch_mode<m, false, false, false, false, false, true>(map_a, map_b, map_z, map_out0, map_out1, p,
                                                                     num_sms, stream);
    if constexpr (m == GemmMode::kDownGrad || m == GemmMode::kGateUpGrad) {  // b_k_major: checked above
      if (args.fp8 && args.a_scales_by_k_block)
        return launch_mode<m, false, false, true, true, true>(map_a, map_b, map_z, map_out0, map_out1, p, num_sms, stream);
      if (args.fp8) return launch_mode<m, false, false, true, true>(map_a, map_b, map_z, map_out0, map_out1, p, num_sms, stream);
    }
    if constexpr (m == GemmMode::kWeightGrad) {  // A^T and B^T, K-major; one CTA per tile (no pairs)
      if (args.fp8) return launch_mode<m, false, false, false, true>(map_a, map_b, map_z, map_out0, map_out1, p, num_sms, stream);
    }
    if constexpr (ModeTraits<m>::kPairs) {
      if (pair) return launch_mode<m, true, false>(map_a, map_b, map_z, map_out0, map_out1, p, num_sms, stream);
    }
    if constexpr (m == GemmMode::kDownGrad || m == GemmMode::kGateUpGrad) {
      if (args.b_k_major) return launch_mode<m, false, false, true>(map_a, map_b, map_z, map_out0, map_out1, p, num_sms, stream);
    }
    if constexpr (m != GemmMode::kWeightGrad) {  // rows_ready: refused above for kWeightGrad
      if (args.rows_ready != nullptr)
        return launch_mode<m, false, true>(map_a, map_b, map_z, map_out0, map_out1, p, num_sms, stream);
    }
    return launch_mode<m, false, false>(map_a, map_b, map_z, map_out0, map_out1, p, num_sms, stream);
  };
  switch (args.mode) {
    case GemmMode::kGateUp: return launch(std::integral_constant<GemmMode, GemmMode::kGateUp>{});
    case GemmMode::kDown: return launch(std::integral_constant<GemmMode, GemmMode::kDown>{});
    case GemmMode::kDownGrad: return launch(std::integral_constant<GemmMode, GemmMode::kDownGrad>{});
    case GemmMode::kGateUpGrad: return launch(std::integral_constant<GemmMode, GemmMode::kGateUpGrad>{});
    case GemmMode::kWeightGrad: return launch(std::integral_constant<GemmMode, GemmMode::kWeightGrad>{});
  }
  return internal_error("grouped GEMM: unknown mode");
}

}  // namespace megamoe::cuda
