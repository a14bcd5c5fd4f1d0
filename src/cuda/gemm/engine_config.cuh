// Compile-time configuration of the grouped GEMM engine: threads and register
// split, tile and stage shapes per mode, the shared-memory budget, and the
// checks that keep them consistent. Device code; included by grouped_gemm.cu.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/common/device_errors.h"
#include "cuda/gemm/grouped_gemm.h"

namespace megamoe::cuda::engine {

// Warpgroup 0: the producer (one thread issues the TMA loads; on split rings one a ring); 1, 2: consumers.
inline constexpr int kThreads = 384;
// Registers: the kernel launches with kLaunchRegs per thread (the most
// __launch_bounds__(384, 1) allows), and that pool of kLaunchRegs x 384 is all
// setmaxnreg can share out: the producer gives some back (dec) and the
// consumers take them (inc), which blocks for good if the pool cannot cover
// it. So P x 128 + C x 256 must fit kLaunchRegs x 384 (not the SM's 65536).
// A consumer holds a 128 x 128 fp32 tile (128 per thread).
inline constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;  // 168
// FP8: producer 40, consumers 232, on one shared ring and on split rings
// alike (until session 27 one split-ring producer thread kept a cursor per
// ring in 56 registers, and the consumers' 224 made some FP8 kernels spill).
// bf16: 56 / 224 (every bf16 kernel compiles without spills), so that the
// side jobs' copies keep four loads in flight a lane (side_jobs.cuh); with 40
// the side-job kernels were 20-40% slower, the others the same (session 36).
template <bool kFp8>
struct RegisterSplit {
  static constexpr int kProducer = kFp8 ? 40 : 56, kConsumer = kFp8 ? 232 : 224;
};
inline constexpr int kConsumerThreads = 128;
inline constexpr int kAccPerThread = kBlockM * kBlockN / kConsumerThreads;  // fp32 accumulators
template <bool kFp8>
inline constexpr bool kRegisterSplitFits =
    RegisterSplit<kFp8>::kProducer * 128 + RegisterSplit<kFp8>::kConsumer * 2 * 128 <= kLaunchRegs * kThreads &&
    RegisterSplit<kFp8>::kProducer % 8 == 0 && RegisterSplit<kFp8>::kConsumer % 8 == 0 &&
    kAccPerThread + 64 <= RegisterSplit<kFp8>::kConsumer;
static_assert(kRegisterSplitFits<false> && kRegisterSplitFits<true>,
              "the register split exceeds the launch's pool, is not in setmaxnreg's multiples of 8, or leaves the "
              "epilogue too few registers beside the accumulators");

using Elem = uint16_t;  // bf16 operands, as raw 2-byte elements in shared memory
inline constexpr int kBox = 64;                               // TMA box edge (elements)
inline constexpr int kBoxBytes = kBox * kBox * sizeof(Elem);  // one 128B-swizzled box: 64 rows x 128 bytes
inline constexpr int kTileBytesA = kBlockM * kBlockK * sizeof(Elem);  // 16 KB: two boxes
inline constexpr int kTileBytesB = kBlockN * kBlockK * sizeof(Elem);  // 16 KB: two boxes
inline constexpr int kStageBytes = kTileBytesA + kTileBytesB;
// 128 x 256 tiles (the kernel's kWide; bf16 kGateUp, kDown, kGateUpGrad,
// kWeightGrad): a stage holds A's 128 rows and 256 rows (or columns) of B
// (kGateUp: 128 gate, then the matching 128 up rows).
template <bool kWide>
inline constexpr int kStageBytesOf = kWide ? kTileBytesA + 2 * kTileBytesB : kStageBytes;
// kDownGrad's z chunk: 64 rows of a tile's g and u columns, four boxes.
inline constexpr int kZChunkBytes = 4 * kBoxBytes;
inline constexpr int kStagePad = 8;  // staging row padding (elements): fewer bank conflicts
inline constexpr int kStagingLd = kBlockN + kStagePad;
static_assert(kBlockK * sizeof(Elem) == 128, "a K-major box row must be one 128-byte swizzle row");
static_assert(kBlockM == 2 * kBox && kBlockN == 2 * kBox && kBlockK == kBox, "tiles are 2 x 2 (A, B) boxes");
static_assert(kBlockM == 2 * 64, "a consumer's tile is two m64 wgmma accumulators");
static_assert(kStageBytes % 1024 == 0, "stages must keep the 1024-byte alignment of the 128B swizzle");

template <GemmMode M>
struct ModeTraits {
  static constexpr bool kAMnMajor = M == GemmMode::kWeightGrad;
  static constexpr bool kBMnMajor =
      M == GemmMode::kDownGrad || M == GemmMode::kGateUpGrad || M == GemmMode::kWeightGrad;
  // Each consumer has an epilogue buffer of its own: the bf16 staging tile of
  // the modes that store their output rows from it (kStaged: bulk copies in
  // bf16, 16-byte stores in FP8, epilogues.cuh store_rows), or
  // kDownGrad's z chunk, which TMA loads the saved z into and its outputs
  // are stored from (kZChunks); kWeightGrad writes straight from registers.
  static constexpr bool kStaged = M == GemmMode::kGateUp || M == GemmMode::kDown || M == GemmMode::kGateUpGrad;
  static constexpr bool kZChunks = M == GemmMode::kDownGrad;
  static constexpr int kEpilogueBytes = kStaged ? kBlockM * kStagingLd * 2 : kZChunks ? kZChunkBytes : 0;
  static constexpr int kStages = kStaged ? 4 : kZChunks ? 5 : 6;
  // Pairs of CTAs sharing A by multicast (grouped_gemm.cu, load_stage): only
  // where they measured faster. Qwen3-30B-A3B, 16384 tokens, Nsight Compute,
  // one CTA -> pair: kWeightGrad dW13 1.68 -> 1.47 ms, dW2 749 -> 754 us;
  // kGateUp 1.29 -> 1.34 ms, kDown 823 -> 819 us, kDownGrad 818 -> 852 us,
  // kGateUpGrad 1.35 -> 1.37 ms (perf-log, session 17).
  static constexpr bool kPairs = M == GemmMode::kWeightGrad;
  static constexpr int kBarriers = 2 * kStages + 4;
  // The slot-writing modes' row destinations (epilogues.cuh begin_slot_epilogue): a pointer per tile row, per
  // consumer, [2][kBlockM]; then kDown's routing weight per tile row, [2][kBlockM] f32.
  static constexpr int kRowDstBytes =
      M == GemmMode::kDown ? 2 * kBlockM * (8 + 4) : M == GemmMode::kGateUpGrad ? 2 * kBlockM * 8 : 0;
  static_assert(kEpilogueBytes % 1024 == 0, "epilogue buffers must keep the 1024-byte alignment of the 128B swizzle");
};

// The stages a kernel keeps in shared memory: the FP8 kernels' split rings
// (pipeline.cuh) use two rings of kStages / 2, so kDownGrad leaves its
// unused fifth stage out.
template <GemmMode M, bool kFp8, bool kRing>
inline constexpr int kStagesUsed = kFp8 ? ModeTraits<M>::kStages / 2 * 2 : ModeTraits<M>::kStages;

// A consumer's epilogue buffer: the FP8 kernels stage a row half (64 rows) at
// a time (epilogues.cuh store_rows, kDirect), so that their shared memory
// stays under the 196 KB carve-out and L1 keeps 60 KB instead of 28 (the
// M-grouped FP8 consumers read A's row scales through it: 16 KB of lines a
// tile).
template <GemmMode M, bool kFp8>
inline constexpr int kEpilogueBytesOf =
    kFp8 && ModeTraits<M>::kStaged ? ModeTraits<M>::kEpilogueBytes / 2 : ModeTraits<M>::kEpilogueBytes;
static_assert(kEpilogueBytesOf<GemmMode::kGateUp, true> % 1024 == 0, "epilogue buffers keep the 1024-byte alignment");

// The scale ring: the producer brings each k-block's scales into a slot
// beside its stage, read from shared memory by the promotion. FP8
// kWeightGrad: 128 A and 128 B scales (it scales per element: a row scale
// times a column scale per 128-row k-block); M-grouped FP8 with
// a_scales_by_k_block: A's 128 row scales (the first half of the slot).
// Bytes per slot, and in all for a kernel with a ring (kRing).
inline constexpr int kScaleStageBytes = 2 * 128 * 4;
// Which kernels have one: FP8 kWeightGrad's (A and B scales), kARing's (A's).
template <GemmMode M, bool kFp8, bool kARing>
inline constexpr bool has_scale_ring = kFp8 && (M == GemmMode::kWeightGrad || kARing);
template <GemmMode M, bool kFp8, bool kRing>
inline constexpr int kScaleRingBytes = kRing ? kStagesUsed<M, kFp8, kRing> * kScaleStageBytes : 0;

// FP8 kGateUp's consumers take the two column tiles n = 2j, 2j + 1 of one row
// tile together (TileScheduler::pair_tile): the pair reads the same A rows
// at the same time (kGateUp -5%, -10% without its epilogue, at 235B;
// perf-log, session 41).
template <GemmMode M, bool kFp8>
inline constexpr bool kPairedColumns = kFp8 && M == GemmMode::kGateUp;

// Shared memory: [align pad][stages used][scale ring][epilogue buffer x 2][mbarriers: full, empty (kStages
// each), order [2], z_full [2]][row_dst: 2 x 128 pointers (kDown, kGateUpGrad)][abort flag: u32, padded to 16 bytes]
template <GemmMode M, bool kFp8, bool kRing>
inline constexpr int kSmemBytes = 1024 + kStagesUsed<M, kFp8, kRing> * kStageBytes + kScaleRingBytes<M, kFp8, kRing> +
                                  2 * kEpilogueBytesOf<M, kFp8> + ModeTraits<M>::kBarriers * 8 +
                                  ModeTraits<M>::kRowDstBytes + 16;
// Wide tiles (kWide: kGateUp and kDown, bf16; kGateUpGrad and kWeightGrad
// unless GroupedGemmArgs::narrow_tiles): kWideStages stages of 48 KB,
// and each consumer's epilogue buffer kWideBoxes 128B-swizzled 64 x 64 boxes
// (8 KB each). kGateUp passes z's gate and up halves and a through it on
// their way out by TMA store: with 2 boxes (4 stages) one at a time, with 4
// (3 stages) z's two halves at once, then a. kDown passes its 256 columns
// through it in 128-column halves, and kGateUpGrad the same; kWeightGrad
// stores from registers (its buffers go unused). A consumer holds 64 tile
// rows, so the row destinations (kDown, kGateUpGrad) take half the narrow
// tiles' room.
inline constexpr int kWideStages = 4;
inline constexpr int kWideBoxes = kWideStages >= 4 ? 2 : 4;
inline constexpr int kWideEpilogueBytes = kWideBoxes * kBoxBytes;
// kDownGrad's wide tiles (GroupedGemmArgs::wide_down_grad): a consumer's z
// chunk is its 64 rows x a 128-column half of the tile (g and u: the narrow
// tiles' 32 KB chunk, a column half instead of a row half), so two chunks of
// 32 KB and 3 stages (208 KB; 4 would need 256).
template <GemmMode M>
inline constexpr int kWideStagesOf = M == GemmMode::kDownGrad ? 3 : kWideStages;
template <GemmMode M>
inline constexpr int kWideEpilogueBytesOf = M == GemmMode::kDownGrad ? kZChunkBytes : kWideEpilogueBytes;
// Tile rows a consumer's row destinations cover, and their bytes for both consumers.
template <bool kWide>
inline constexpr int kRowDstRows = kWide ? kBlockM / 2 : kBlockM;
template <GemmMode M, bool kWide>
inline constexpr int kRowDstBytesOf = ModeTraits<M>::kRowDstBytes / kBlockM * kRowDstRows<kWide>;
template <GemmMode M>
inline constexpr int kSmemBytesWide = 1024 + kWideStagesOf<M> * kStageBytesOf<true> + 2 * kWideEpilogueBytesOf<M> +
                                      ModeTraits<M>::kBarriers * 8 + kRowDstBytesOf<M, true> + 16;
static_assert(kWideStages <= ModeTraits<GemmMode::kGateUp>::kStages &&
                  kWideStages <= ModeTraits<GemmMode::kDown>::kStages,
              "the modes' barrier areas hold the wide ring's");
static_assert(kWideStages <= ModeTraits<GemmMode::kGateUpGrad>::kStages &&
                  kWideStages <= ModeTraits<GemmMode::kWeightGrad>::kStages,
              "the backward modes' barrier areas hold the wide ring's");
static_assert(kWideStagesOf<GemmMode::kDownGrad> <= ModeTraits<GemmMode::kDownGrad>::kStages &&
                  kSmemBytesWide<GemmMode::kDownGrad> <= 227 * 1024,
              "kDownGrad's wide tiles: its barrier area and the 227 KB");
static_assert(kSmemBytesWide<GemmMode::kGateUp> <= 227 * 1024 && kSmemBytesWide<GemmMode::kDown> <= 227 * 1024 &&
                  kSmemBytesWide<GemmMode::kGateUpGrad> <= 227 * 1024 &&
                  kSmemBytesWide<GemmMode::kWeightGrad> <= 227 * 1024,
              "wide tiles exceed the 227 KB an H100/H200 CTA may use");
static_assert(kStageBytesOf<true> % 1024 == 0, "stages must keep the 1024-byte alignment of the 128B swizzle");

template <GemmMode M>
constexpr bool smem_fits() {  // every instantiation the engine builds (bf16; FP8 with and without the ring)
  constexpr int kMax = 227 * 1024;  // what an H100 / H200 CTA may use
  return kSmemBytes<M, false, false> <= kMax && kSmemBytes<M, true, false> <= kMax && kSmemBytes<M, true, true> <= kMax;
}
static_assert(smem_fits<GemmMode::kGateUp>() && smem_fits<GemmMode::kDown>() && smem_fits<GemmMode::kDownGrad>() &&
                  smem_fits<GemmMode::kGateUpGrad>() && smem_fits<GemmMode::kWeightGrad>(),
              "shared memory exceeds the 227 KB an H100/H200 CTA may use");

// The carve-out hint for a block needing `bytes` of shared memory: the
// smallest of the SM's supported sizes (KB) that holds it, as the percentage
// of the 228 KB maximum that rounds up to that size (rounded down).
constexpr int carveout_percent(int bytes) {
  constexpr int kSizesKb[] = {0, 8, 16, 32, 64, 100, 132, 164, 196, 228};
  for (int kb : kSizesKb)
    if (kb * 1024 >= bytes) return kb * 100 / 228;
  return 100;
}
static_assert(carveout_percent(kSmemBytes<GemmMode::kDownGrad, true, false> + 1024) == 85 &&
                  carveout_percent(kSmemBytes<GemmMode::kGateUp, true, false> + 1024) == 85 &&
                  carveout_percent(kSmemBytes<GemmMode::kDown, true, false> + 1024) == 85 &&
                  85 * 228 >= 164 * 100 && carveout_percent(232448) == 100,
              "the M-grouped FP8 kernels (164-194 KB): the 196 KB carve-out (85% of 228, above 164 KB)");

// The KernelId a timed-out wait of mode M reports.
template <GemmMode M>
constexpr uint32_t kernel_id() {
  switch (M) {
    case GemmMode::kGateUp: return kKernelGemmGateUp;
    case GemmMode::kDown: return kKernelGemmDown;
    case GemmMode::kDownGrad: return kKernelGemmDownGrad;
    case GemmMode::kGateUpGrad: return kKernelGemmGateUpGrad;
    case GemmMode::kWeightGrad: return kKernelGemmWeightGrad;
  }
  return kKernelCount;
}

struct KernelParams {
  GroupedGemmArgs args;
  int n_tiles;   // output column tiles
  int m_tiles;   // kWeightGrad: row tiles of dW[e]
  int k_blocks;  // M-grouped modes: k / elements per k-block (64 bf16, 128 e4m3: one 128-byte box row)
};

// The kernel's gathered operand (GroupedGemmArgs::gather), as a template int.
inline constexpr int kGatherNone = 0, kGatherA = 1, kGatherB = 2;

// FP8: elements per k-block (one 128-byte swizzle row of e4m3).
inline constexpr int kBlockKFp8 = 128;

}  // namespace megamoe::cuda::engine
