// What one instantiation of the grouped GEMM kernel is, as compile-time
// values that host and device code share: its key (mode, element type, tile
// shape, row holds), the list of keys that are built, and each key's shapes
// (threads, register split, stages, buffers) and shared-memory layout
// (SharedStorage, whose sizeof is the budget). No CUDA here: the host
// selection (kernel_config.h) and its CPU tests read the same numbers the
// kernel is compiled with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/host_device.h"
#include "cuda/gemm/grouped_gemm.h"

namespace megamoe::cuda::engine {

// 128 x 128 tiles (two consumers taking tiles in turn, or on split rings at
// once), or 128 x 256 (bf16: both consumers on each tile, a row half each).
enum class TileShape { k128x128, k128x256 };
// kWaitForRows: the producer holds each pool tile until its rows are in
// (GroupedGemmArgs::arrival); bf16 kGateUp only, whose own side gather is
// the writer in the layer.
enum class RowHold { kNone, kWaitForRows };

struct KernelKey {
  GemmMode mode;
  ElemType elem;
  TileShape tile;
  RowHold hold;
  MEGAMOE_HD constexpr bool operator==(const KernelKey& o) const {
    return mode == o.mode && elem == o.elem && tile == o.tile && hold == o.hold;
  }
};

// Every instantiation the engine builds: those the layer's calls select
// (tests/cpu/kernel_config_test.cpp holds every layer call against this list).
//   bf16 kGateUp: 128 x 256 (I % 128 == 0 always), its rows held on its own side gather or not;
//   bf16 kDown, kGateUpGrad, kWeightGrad: 128 x 256 where N % 256 == 0 (and no peer slots), else 128 x 128;
//   bf16 kDownGrad: 128 x 128;
//   e4m3: every mode in 128 x 128 tiles on split rings.
inline constexpr KernelKey kBuiltKernels[] = {
    {GemmMode::kGateUp, ElemType::kBF16, TileShape::k128x256, RowHold::kNone},
    {GemmMode::kGateUp, ElemType::kBF16, TileShape::k128x256, RowHold::kWaitForRows},
    {GemmMode::kDown, ElemType::kBF16, TileShape::k128x128, RowHold::kNone},
    {GemmMode::kDown, ElemType::kBF16, TileShape::k128x256, RowHold::kNone},
    {GemmMode::kDownGrad, ElemType::kBF16, TileShape::k128x128, RowHold::kNone},
    {GemmMode::kGateUpGrad, ElemType::kBF16, TileShape::k128x128, RowHold::kNone},
    {GemmMode::kGateUpGrad, ElemType::kBF16, TileShape::k128x256, RowHold::kNone},
    {GemmMode::kWeightGrad, ElemType::kBF16, TileShape::k128x128, RowHold::kNone},
    {GemmMode::kWeightGrad, ElemType::kBF16, TileShape::k128x256, RowHold::kNone},
    {GemmMode::kGateUp, ElemType::kE4M3, TileShape::k128x128, RowHold::kNone},
    {GemmMode::kDown, ElemType::kE4M3, TileShape::k128x128, RowHold::kNone},
    {GemmMode::kDownGrad, ElemType::kE4M3, TileShape::k128x128, RowHold::kNone},
    {GemmMode::kGateUpGrad, ElemType::kE4M3, TileShape::k128x128, RowHold::kNone},
    {GemmMode::kWeightGrad, ElemType::kE4M3, TileShape::k128x128, RowHold::kNone},
};
inline constexpr int kNumBuiltKernels = static_cast<int>(sizeof(kBuiltKernels) / sizeof(kBuiltKernels[0]));

MEGAMOE_HD constexpr bool kernel_is_built(KernelKey key) {
  for (const KernelKey& k : kBuiltKernels)
    if (k == key) return true;
  return false;
}

// ---- threads and registers ----------------------------------------------------
// Warpgroup 0: the producer (one thread issues the TMA loads; on split rings
// one a ring) and the side jobs (warps 1-3, bf16); 1, 2: the consumers.
inline constexpr int kThreads = 384;
inline constexpr int kConsumerThreads = 128;
// The kernel launches with kLaunchRegs per thread (the most
// __launch_bounds__(384, 1) allows), and that pool of kLaunchRegs x 384 is all
// setmaxnreg can share out: the producer gives some back (dec) and the
// consumers take them (inc), which blocks for good if the pool cannot cover
// it. So P x 128 + C x 256 must fit kLaunchRegs x 384 (not the SM's 65536).
inline constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;  // 168
// A consumer holds a 128 x 128 fp32 tile (128 per thread).
inline constexpr int kAccPerThread = kBlockM * kBlockN / kConsumerThreads;
// FP8: producer 40, consumers 232 (the promotion's temporary beside the
// accumulators). bf16: 56 / 224 (every bf16 kernel compiles without spills),
// so that the side jobs' copies keep four loads in flight a lane
// (side_jobs.cuh); with 40 the side-job kernels ran 20-40% slower.
struct RegisterSplit {
  int producer, consumer;
};
MEGAMOE_HD constexpr RegisterSplit register_split(ElemType elem) {
  return elem == ElemType::kE4M3 ? RegisterSplit{40, 232} : RegisterSplit{56, 224};
}
MEGAMOE_HD constexpr bool register_split_fits(ElemType elem) {
  const RegisterSplit r = register_split(elem);
  return r.producer * 128 + r.consumer * 2 * 128 <= kLaunchRegs * kThreads && r.producer % 8 == 0 &&
         r.consumer % 8 == 0 && kAccPerThread + 64 <= r.consumer;
}
static_assert(register_split_fits(ElemType::kBF16) && register_split_fits(ElemType::kE4M3),
              "the register split exceeds the launch's pool, is not in setmaxnreg's multiples of 8, or leaves the "
              "epilogue too few registers beside the accumulators");

// ---- tiles, stages, buffers ------------------------------------------------------
inline constexpr int kBox = 64;                      // TMA box edge (elements of bf16; e4m3 boxes are 64 x 128)
inline constexpr int kBoxBytes = kBox * kBox * 2;    // one 128B-swizzled box: 64 rows x 128 bytes
inline constexpr int kTileBytesA = 2 * kBoxBytes;    // 16 KB: A's 128 rows of one k-block
inline constexpr int kBlockKFp8 = 128;               // e4m3 elements per k-block (one 128-byte box row)
inline constexpr int kStagePad = 8;                  // staging row padding (elements): fewer bank conflicts
inline constexpr int kStagingLd = kBlockN + kStagePad;
inline constexpr int kZChunkBytes = 4 * kBoxBytes;   // kDownGrad: 64 rows of a tile's g and u columns
inline constexpr int kScaleStageBytes = 2 * 128 * 4; // FP8 kWeightGrad: a k-block's 128 A and 128 B scales
static_assert(kBlockK * 2 == 128, "a K-major bf16 box row must be one 128-byte swizzle row");
static_assert(kBlockM == 2 * kBox && kBlockN == 2 * kBox && kBlockK == kBox, "tiles are 2 x 2 (A, B) boxes");

MEGAMOE_HD constexpr bool is_fp8(KernelKey k) { return k.elem == ElemType::kE4M3; }
MEGAMOE_HD constexpr bool is_wide(KernelKey k) { return k.tile == TileShape::k128x256; }
// Modes whose epilogue stages bf16 output rows through shared memory (bulk
// copies in bf16, 16-byte stores in FP8).
MEGAMOE_HD constexpr bool stages_rows(GemmMode m) {
  return m == GemmMode::kGateUp || m == GemmMode::kDown || m == GemmMode::kGateUpGrad;
}
// Ring stages: the 128 x 128 modes' measured best (the staged modes' epilogue
// buffers leave room for 4, kDownGrad's z chunks for 5, kWeightGrad's none
// for 6); FP8 runs them as two split rings of half each (kDownGrad 2 + 2);
// 128 x 256 tiles hold 4 stages of 48 KB.
MEGAMOE_HD constexpr int stage_count(KernelKey k) {
  if (is_wide(k)) return 4;
  const int narrow = stages_rows(k.mode) ? 4 : k.mode == GemmMode::kDownGrad ? 5 : 6;
  return is_fp8(k) ? narrow / 2 * 2 : narrow;
}
// One stage: A's 128 rows and B's 128 (wide: 256) rows or columns of a k-block.
MEGAMOE_HD constexpr int stage_bytes(KernelKey k) { return kTileBytesA * (is_wide(k) ? 3 : 2); }
// Each consumer's epilogue buffer: the bf16 staging tile of the modes that
// stage rows (FP8: a 64-row half at a time, so that the M-grouped FP8
// kernels stay under the 196 KB carve-out and L1 keeps 60 KB, which the
// consumers' A row scale loads use), kDownGrad's z chunk, the wide tiles'
// two 128B-swizzled boxes (kGateUp's z and a, kDown's and kGateUpGrad's row
// halves pass through them). kWeightGrad writes from registers; its wide
// kernel keeps the two boxes unused, so that its shared memory stays in the
// carve-out its speed was measured with (228 KB, no L1 to speak of).
MEGAMOE_HD constexpr int epilogue_bytes(KernelKey k) {
  if (k.mode == GemmMode::kDownGrad) return kZChunkBytes;
  if (is_wide(k)) return 2 * kBoxBytes;
  if (!stages_rows(k.mode)) return 0;
  return kBlockM * kStagingLd * 2 / (is_fp8(k) ? 2 : 1);
}
// The slot-writing modes' row destinations (kDown, kGateUpGrad): a pointer per
// tile row a consumer holds, per consumer; kDown's routing weights beside them.
MEGAMOE_HD constexpr int row_dst_rows(KernelKey k) {
  return k.mode == GemmMode::kDown || k.mode == GemmMode::kGateUpGrad ? (is_wide(k) ? kBlockM / 2 : kBlockM) : 0;
}
MEGAMOE_HD constexpr int row_weight_rows(KernelKey k) {
  return k.mode == GemmMode::kDown ? row_dst_rows(k) : 0;
}
MEGAMOE_HD constexpr int scale_ring_floats(KernelKey k) {
  return is_fp8(k) && k.mode == GemmMode::kWeightGrad ? stage_count(k) * kScaleStageBytes / 4 : 0;
}

// ---- shared memory ----------------------------------------------------------------
struct NoSection {};
// N elements of T, or nothing (an empty member: a byte and its padding).
template <typename T, int N>
using Section = std::conditional_t<(N > 0), T[(N > 0 ? N : 1)], NoSection>;

// A CTA's shared memory, from a 1024-byte aligned base (the 128B swizzle
// repeats every 1024 bytes): the ring's stages, each consumer's epilogue
// buffer, the FP8 weight gradient's scale ring, the mbarriers, the
// slot-writing modes' row destinations and routing weights, and the CTA's
// state word (BoundedWait). A stage holds A's two 64 x 64 boxes (kTileBytesA),
// then B's two (wide: four); the epilogue buffers are 1024-aligned because
// stages are whole multiples of 1024 bytes.
template <typename Spec>
struct SharedStorage {
  static constexpr KernelKey kKey = Spec::kKey;
  static constexpr int kStages = stage_count(kKey);
  static constexpr int kEpilogue = epilogue_bytes(kKey);
  uint8_t stages[kStages][stage_bytes(kKey)];
  Section<uint8_t[(kEpilogue > 0 ? kEpilogue : 1)], (kEpilogue > 0 ? 2 : 0)> epilogue;
  // [stages][A 128 | B 128] f32: a k-block's scales, bulk-loaded with its stage.
  alignas(16) Section<float, scale_ring_floats(kKey)> scale_ring;
  uint64_t full[kStages];   // stage s loaded (the producer's expect-tx arrival plus the TMA bytes)
  uint64_t empty[kStages];  // stage s free (one arrival per consumer warp that read it; per lane with a scale ring)
  uint64_t order[2];        // the consumers' turns on a shared ring (OrderBarriers)
  uint64_t z_full[2];       // kDownGrad: a consumer's z chunk has landed
  Section<void*, 2 * row_dst_rows(kKey)> row_dst;     // [2][rows]: each tile row's destination (bf16*)
  Section<float, 2 * row_weight_rows(kKey)> row_w;    // [2][rows]: kDown, each tile row's routing weight
  uint32_t cta_state;
};

// What a launch asks for: the struct and the worst alignment pad of the base.
template <typename Spec>
MEGAMOE_HD constexpr int smem_bytes() {
  return static_cast<int>(sizeof(SharedStorage<Spec>)) + 1024;
}
inline constexpr int kMaxSmemBytes = 227 * 1024;  // what an H100 / H200 CTA may use

// The compile-time description of one kernel: its key and what follows from it.
template <GemmMode M, ElemType E, TileShape T, RowHold H>
struct KernelSpec {
  static constexpr KernelKey kKey{M, E, T, H};
  static constexpr GemmMode kMode = M;
  static constexpr bool kFp8 = E == ElemType::kE4M3;
  static constexpr bool kWide = T == TileShape::k128x256;
  static constexpr bool kHoldRows = H == RowHold::kWaitForRows;
  // FP8: one ring per consumer, their main loops at the same time (the
  // promotion leaves each warpgroup's tensor-core slots idle between
  // k-blocks; the other's wgmmas fill them).
  static constexpr bool kSplitRings = kFp8;
  static constexpr bool kScaleRing = kFp8 && M == GemmMode::kWeightGrad;
  // FP8 kGateUp: the two consumers take column tiles 2j, 2j + 1 of one row
  // tile together, reading the same A rows at once.
  static constexpr bool kPairedColumns = kFp8 && M == GemmMode::kGateUp;
  // FP8's wgmma reads K-major operands only: kDownGrad and kGateUpGrad read B
  // transposed; kWeightGrad both (A^T, B^T).
  static constexpr bool kBTransposed = kFp8 && (M == GemmMode::kDownGrad || M == GemmMode::kGateUpGrad);
  static constexpr bool kAMnMajor = !kFp8 && M == GemmMode::kWeightGrad;
  static constexpr bool kBMnMajor =
      !kFp8 && (M == GemmMode::kDownGrad || M == GemmMode::kGateUpGrad || M == GemmMode::kWeightGrad);
  static constexpr bool kZChunks = M == GemmMode::kDownGrad;
  static constexpr bool kStagedRows = stages_rows(M);
  static constexpr int kStages = stage_count(kKey);
  static constexpr int kRingStages = kSplitRings ? kStages / 2 : kStages;  // one consumer's ring
  static constexpr int kStageBytes = stage_bytes(kKey);
  static constexpr int kEpilogueBytes = epilogue_bytes(kKey);
  static constexpr int kRowDstRows = row_dst_rows(kKey);
  static constexpr int kKBlock = kFp8 ? kBlockKFp8 : kBlockK;  // elements of K per stage
  static constexpr RegisterSplit kRegs = register_split(E);
  static_assert(kernel_is_built(kKey), "an instantiation that is not in kBuiltKernels");
  static_assert(kStageBytes % 1024 == 0 && kEpilogueBytes % 1024 == 0,
                "stages and epilogue buffers must keep the 1024-byte alignment of the 128B swizzle");
  static_assert(!kHoldRows || (M == GemmMode::kGateUp && !kFp8), "held rows: bf16 kGateUp");
  static_assert(!kWide || !kFp8, "128 x 256 tiles: bf16");
};

// Every built kernel's shared memory, checked here once: its struct within
// the 227 KB, and its stages where the swizzle needs them.
template <int I>
constexpr bool smem_fits() {
  if constexpr (I == kNumBuiltKernels) {
    return true;
  } else {
    constexpr KernelKey k = kBuiltKernels[I];
    using Spec = KernelSpec<k.mode, k.elem, k.tile, k.hold>;
    static_assert(smem_bytes<Spec>() <= kMaxSmemBytes, "a kernel's shared memory exceeds what a CTA may use");
    static_assert(offsetof(SharedStorage<Spec>, epilogue) % 1024 == 0, "epilogue buffers off the 1024 alignment");
    return smem_fits<I + 1>();
  }
}
static_assert(smem_fits<0>(), "shared memory of the built kernels");

// Calls fn(Spec{}) for the KernelSpec of every built kernel, in list order.
template <typename Fn, int I = 0>
constexpr void for_each_built_kernel(Fn&& fn) {
  if constexpr (I < kNumBuiltKernels) {
    constexpr KernelKey k = kBuiltKernels[I];
    fn(KernelSpec<k.mode, k.elem, k.tile, k.hold>{});
    for_each_built_kernel<Fn, I + 1>(static_cast<Fn&&>(fn));
  }
}

// The kernel's parameter block (__grid_constant__): the arguments and the
// tile counts the host derived (kernel_config.h), and the test overrides.
struct KernelParams {
  GroupedGemmArgs args;
  int n_tiles;   // output column tiles
  int m_tiles;   // kWeightGrad: row tiles of dW[e]
  int k_blocks;  // M-grouped modes: k / elements per k-block (64 bf16, 128 e4m3: one 128-byte box row)
  int64_t stall_at;    // GemmOverrides::stall_at
  bool skip_epilogue;  // GemmOverrides::skip_epilogue
};

// The carve-out hint for a block needing `bytes` of shared memory: the
// smallest of the SM's supported sizes (KB) that holds it, as the percentage
// of the 228 KB maximum that rounds up to that size (rounded down).
MEGAMOE_HD constexpr int carveout_percent(int bytes) {
  constexpr int kSizesKb[] = {0, 8, 16, 32, 64, 100, 132, 164, 196, 228};
  for (int kb : kSizesKb)
    if (kb * 1024 >= bytes) return kb * 100 / 228;
  return 100;
}

// The KernelId a timed-out wait of a kernel reports.
MEGAMOE_HD constexpr uint32_t kernel_id(KernelKey k) {
  const bool w = is_wide(k);
  switch (k.mode) {
    case GemmMode::kGateUp: return w ? kKernelGemmGateUpWide : kKernelGemmGateUp;
    case GemmMode::kDown: return w ? kKernelGemmDownWide : kKernelGemmDown;
    case GemmMode::kDownGrad: return kKernelGemmDownGrad;
    case GemmMode::kGateUpGrad: return w ? kKernelGemmGateUpGradWide : kKernelGemmGateUpGrad;
    case GemmMode::kWeightGrad: return w ? kKernelGemmWeightGradWide : kKernelGemmWeightGrad;
  }
  return kKernelCount;
}

}  // namespace megamoe::cuda::engine
