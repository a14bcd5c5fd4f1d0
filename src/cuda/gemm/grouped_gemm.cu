// The grouped GEMM engine: a persistent kernel with one producer warp issuing
// TMA loads into a ring of shared-memory stages and two consumer warpgroups
// that take the CTA's tiles in turn ("ping-pong"): while one runs a tile's
// wgmma main loop the other runs the previous tile's fused epilogue, so the
// tensor cores do not wait for epilogues. Epilogues stage bf16 output through
// shared memory so that global stores are 16-byte, row-contiguous.
#include <cuda_bf16.h>

#include <string>

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/common/cuda_status.h"
#include "cuda/gemm/tensor_map.h"
#include "cuda/ptx/sm90.cuh"

namespace megamoe::cuda {
namespace {

using namespace ptx;

constexpr int kThreads = 384;                  // warpgroup 0: producer; 1, 2: consumers
// Registers per thread after the split (setmaxnreg): 40 x 128 + 232 x 256 fits
// the 65536 of the SM; a consumer holds a 128 x 128 fp32 tile (128 per thread).
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
constexpr int kTileBytesA = kBlockM * kBlockK * 2;  // 16 KB: two 64-row (or 64-column) boxes
constexpr int kTileBytesB = kBlockN * kBlockK * 2;  // 16 KB
constexpr int kStageBytes = kTileBytesA + kTileBytesB;
constexpr int kBoxBytes = 64 * 64 * 2;         // one 128B-swizzled TMA box: 64 x 128 bytes
constexpr int kStagePad = 8;                   // staging row padding (elements): fewer bank conflicts

template <GemmMode M>
struct ModeTraits {
  static constexpr bool kAMnMajor = M == GemmMode::kWeightGrad;
  static constexpr bool kBMnMajor =
      M == GemmMode::kDownGrad || M == GemmMode::kGateUpGrad || M == GemmMode::kWeightGrad;
  // kWeightGrad and kDownGrad write straight from registers: no staging.
  static constexpr bool kStaged = M != GemmMode::kWeightGrad && M != GemmMode::kDownGrad;
  static constexpr int kStages = kStaged ? 4 : 6;
  // kDownGrad: after its k-blocks each tile takes two more ring stages that
  // bring the saved z (g, then u) of its 128 rows x 128 columns by TMA.
  static constexpr int kZStages = M == GemmMode::kDownGrad ? 2 : 0;
  static constexpr int kStagingBytes = kStaged ? kBlockM * (kBlockN + kStagePad) * 2 : 0;  // per consumer
  // Shared memory: [align pad][stages][staging x 2][full, empty, order mbarriers][tile_src: 2 x 128 x int32]
  // [abort flag: u32, padded to 16 bytes]
  static constexpr int kSmemBytes =
      1024 + kStages * kStageBytes + 2 * kStagingBytes + (2 * kStages + 2) * 8 + 2 * kBlockM * 4 + 16;
};

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
  int n_tiles;  // output column tiles
  int m_tiles;  // kWeightGrad: row tiles of dW[e]
};

// Work of one output tile.
struct Tile {
  int expert, m, n;  // m: pool tile (M-grouped) or dW row tile (kWeightGrad)
  int k_begin;       // first K coordinate (pool row for kWeightGrad, else 0)
  int k_blocks;
};

template <GemmMode M>
__device__ __forceinline__ int num_tiles(const KernelParams& p) {
  if constexpr (M == GemmMode::kWeightGrad) {
    return p.args.plan.num_experts * p.m_tiles * p.n_tiles;
  } else {
    return (*p.args.plan.pool_rows / kBlockM) * p.n_tiles;
  }
}

template <GemmMode M>
__device__ __forceinline__ Tile tile_at(const KernelParams& p, int t) {
  Tile tile;
  if constexpr (M == GemmMode::kWeightGrad) {
    const int per_expert = p.m_tiles * p.n_tiles;
    tile.expert = t / per_expert;
    tile.m = (t % per_expert) / p.n_tiles;
    tile.n = t % p.n_tiles;
    const int rows = p.args.plan.expert_rows[tile.expert];
    tile.k_begin = p.args.plan.expert_offset[tile.expert];
    tile.k_blocks = ((rows + kBlockM - 1) / kBlockM) * (kBlockM / kBlockK);  // segments are 128-padded
  } else {
    tile.m = t / p.n_tiles;
    tile.n = t % p.n_tiles;
    tile.expert = p.args.plan.tile_expert[tile.m];
    tile.k_begin = 0;
    tile.k_blocks = static_cast<int>(p.args.k / kBlockK);
  }
  return tile;
}

// TMA loads of one k-block of a tile: A and B, each as two 64 x 64 boxes.
template <GemmMode M>
__device__ __forceinline__ void load_stage(const KernelParams& p, const CUtensorMap* map_a,
                                           const CUtensorMap* map_b, const Tile& tile, int kb, uint8_t* smem_a,
                                           uint8_t* smem_b, uint64_t* full) {
  using T = ModeTraits<M>;
  const int k0 = tile.k_begin + kb * kBlockK;
  const int e = tile.expert;
  const int I = static_cast<int>(p.args.intermediate);
  for (int box = 0; box < 2; ++box) {
    // A
    if constexpr (T::kAMnMajor) {
      tma_load_2d(smem_a + box * kBoxBytes, map_a, full, tile.m * kBlockM + box * 64, k0);
    } else {
      tma_load_2d(smem_a + box * kBoxBytes, map_a, full, k0, tile.m * kBlockM + box * 64);
    }
    // B
    if constexpr (M == GemmMode::kGateUp) {  // gate rows and the matching up rows
      const int row = e * 2 * I + (box == 0 ? 0 : I) + tile.n * 64;
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, row);
    } else if constexpr (M == GemmMode::kDown) {
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, k0, e * static_cast<int>(p.args.n) + tile.n * kBlockN + box * 64);
    } else if constexpr (M == GemmMode::kWeightGrad) {
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, tile.n * kBlockN + box * 64, k0);
    } else {  // kDownGrad (w2 as [E*H, I]) and kGateUpGrad (w13 as [E*2I, H]): K = rows of expert e
      tma_load_2d(smem_b + box * kBoxBytes, map_b, full, tile.n * kBlockN + box * 64,
                  e * static_cast<int>(p.args.k) + k0);
    }
  }
}

// The z tile of a kDownGrad tile: stage 0 holds g (columns 128n..), stage 1
// u (columns I + 128n..), each as four 64 x 64 boxes, box (row half rh,
// column half ch) at byte (2 rh + ch) * 8 KB.
__device__ __forceinline__ void load_z_stage(const KernelParams& p, const CUtensorMap* map_z, const Tile& tile,
                                             int half, uint8_t* stage, uint64_t* full) {
  const int col0 = (half == 0 ? 0 : static_cast<int>(p.args.intermediate)) + tile.n * kBlockN;
  for (int box = 0; box < 4; ++box)
    tma_load_2d(stage + box * kBoxBytes, map_z, full, col0 + (box & 1) * 64, tile.m * kBlockM + (box >> 1) * 64);
}

// Byte offset of element (row, col) of a 128 x 128 bf16 tile stored as four
// 128B-swizzled 64 x 64 boxes (the layout above): within each 8-row atom,
// 16-byte chunk j of row r sits at chunk j ^ (r % 8).
__device__ __forceinline__ uint32_t swizzled_offset(int row, int col) {
  const int r = row & 63, c = col & 63;
  const int box = (row >> 6) * 2 + (col >> 6);
  return box * kBoxBytes + r * 128 + ((((c >> 3) ^ (r & 7)) << 4) | ((c & 7) * 2));
}

__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + __expf(-g)); }
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// A consumer's tile is two wgmma accumulators, acc[h] for rows [64h, 64h + 64).
// Row of the tile held by element i of acc[h] in this thread, and its column.
__device__ __forceinline__ int acc_row(int h, int i) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  return h * 64 + warp * 16 + (lane >> 2) + 8 * ((i >> 1) & 1);
}
__device__ __forceinline__ int acc_col(int i) { return 8 * (i >> 2) + 2 * (threadIdx.x & 3) + (i & 1); }

constexpr int kStagingLd = kBlockN + kStagePad;

// Accumulator elements i and i + 1 are adjacent columns of one row: stage them
// as one bf16x2 word.
__device__ __forceinline__ void stage_pair(__nv_bfloat16* staging, int h, int i, float v0, float v1) {
  *reinterpret_cast<__nv_bfloat162*>(staging + acc_row(h, i) * kStagingLd + acc_col(i)) = __floats2bfloat162_rn(v0, v1);
}

// The consumer warpgroup's 128 threads copy a staged [128][cols] bf16 tile to
// global rows. dst_row(r, chunk) returns the destination (nullptr: skip).
template <typename RowFn>
__device__ __forceinline__ void copy_out_bf16(const __nv_bfloat16* staging, int cols, RowFn dst_row) {
  const int tid = threadIdx.x & 127;
  const int chunks = cols / 8;
  for (int c = tid; c < kBlockM * chunks; c += 128) {
    const int r = c / chunks, cc = c % chunks;
    __nv_bfloat16* dst = dst_row(r, cc);
    if (dst != nullptr) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(staging + r * kStagingLd + cc * 8);
  }
}

// ---- bounded waits ------------------------------------------------------------
// Every mbarrier wait of the kernel goes through wait_phase: poll try_wait
// (which itself suspends the thread for a hardware-chosen while); after a
// failed poll, look at the clock. A wait that has lasted longer than its bound
// sets the CTA's shared abort flag, reports (kernel, block, barrier, phase,
// waited) to args.errors (the first report per device wins) and returns
// false; so does, promptly, every other wait of the CTA that finds the flag
// set and its own barrier still incomplete kAbortGraceNs later. A caller that
// gets false returns from the kernel (a consumer first retires its wgmma
// groups). No trap: the CUDA context stays usable and the host learns of it
// from take_device_error (kTimeout).
//
// Bounds: full waits (the consumers waiting for loaded stages) give up after
// timeout_ns; empty and order waits (the producer waiting for consumers, a
// consumer for the other one) after 2 x timeout_ns. Those are downstream of a
// stalled full wait, so the wait nearest the cause reports and the others
// then leave through the abort flag.
//
// `phase` in the report is the CTA's running stage iteration `it` at the
// wait: ring stage it % kStages, parity (it / kStages) & 1 (the same numbering
// as debug_stall_at). For an order wait it is the `it` of the first stage of
// the tile the consumer is about to start.
//
// The grace after seeing the flag: a thread leaves only when its barrier has
// not completed for that long, so a TMA load issued just before the abort has
// landed before the CTA's shared memory goes away (loads take microseconds).
//
// What stays unbounded: the named barriers of an epilogue (bar.sync among one
// consumer warpgroup) and the warpgroup-wide (.aligned) wgmma instructions
// cannot time out. All warps of a consumer warpgroup wait on the same
// mbarrier phase at the same place and give up there together; but if that
// phase completes in the instant between one warp giving up and another
// warp's next poll, the second warp goes on alone and can block for good in
// bar.sync or wgmma. That needs a phase to complete just as it times out,
// i.e. a pipeline that was seconds late rather than stuck.
constexpr uint64_t kAbortGraceNs = 1'000'000;  // 1 ms

template <GemmMode M>
__device__ __forceinline__ bool wait_phase(const KernelParams& p, uint32_t* abort_flag, uint64_t* bar, uint32_t parity,
                                           BarrierId barrier, uint32_t phase) {
  if (mbar_try_wait(bar, parity)) return true;
  const uint64_t start = global_timer_ns();
  uint64_t leave_at = ~uint64_t{0};  // set once the abort flag is seen
  for (;;) {
    if (mbar_try_wait(bar, parity)) return true;
    const uint64_t now = global_timer_ns();
    if (now >= leave_at) return false;
    // Shared-memory atomics (slow path only): the flag is read and written by
    // many threads with no barrier between them, by design.
    if (leave_at == ~uint64_t{0} && atomicOr(abort_flag, 0u) != 0u) leave_at = now + kAbortGraceNs;
    const uint64_t waited = now - start;
    if ((barrier == kBarrierFull ? waited : waited / 2) >= p.args.errors.timeout_ns) {
      atomicOr(abort_flag, 1u);
      report_timeout(p.args.errors, kernel_id<M>(), barrier, phase, waited);
      return false;
    }
  }
}

// Barrier of one consumer warpgroup (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void consumer_sync() { named_barrier(threadIdx.x >> 7, 128); }

// Shared memory one consumer's epilogue works in.
struct EpilogueSmem {
  __nv_bfloat16* staging;  // [128][kStagingLd] bf16 (none for kWeightGrad, kDownGrad)
  int32_t* tile_src;       // [128] row_src of the tile's pool rows (kDown, kGateUpGrad)
  const uint8_t* z[2];     // kDownGrad: the g and u stages (swizzled boxes)
  uint64_t* z_empty[2];    // kDownGrad: their empty barriers (released once read)
};

template <GemmMode M>
__device__ __forceinline__ void epilogue(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                         const EpilogueSmem& sm) {
  const GroupedGemmArgs& a = p.args;
  const DevicePlan& plan = a.plan;
  __nv_bfloat16* staging = sm.staging;
  const int64_t I = a.intermediate;
  const int64_t pool_row0 = static_cast<int64_t>(tile.m) * kBlockM;
  const int tid = threadIdx.x & 127;  // thread of this consumer warpgroup
  // Slot-writing modes look up each row's source once (the load overlaps the
  // barrier); the copy-out loop then reads shared memory, not a dependent
  // global load per 16-byte store.
  constexpr bool kSlots = M == GemmMode::kDown || M == GemmMode::kGateUpGrad;
  int32_t my_src = 0;
  if (kSlots && tid < kBlockM) my_src = plan.row_src[pool_row0 + tid];

  consumer_sync();  // the previous tile's copy-out has finished reading staging and tile_src
  if (kSlots && tid < kBlockM) sm.tile_src[tid] = my_src;

  if constexpr (M == GemmMode::kGateUp) {
    // acc columns [0, 64): gate g, [64, 128): up u, both for a-columns 64n + c.
    auto* z_pool = static_cast<__nv_bfloat16*>(a.out0);
    auto* a_pool = static_cast<__nv_bfloat16*>(a.out1);
    if (z_pool != nullptr) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 64; i += 2) stage_pair(staging, h, i, acc[h][i], acc[h][i + 1]);
      consumer_sync();
      copy_out_bf16(staging, kBlockN, [&](int r, int cc) {
        const int64_t col = cc < 8 ? tile.n * 64 + cc * 8 : I + tile.n * 64 + (cc - 8) * 8;
        return z_pool + (pool_row0 + r) * 2 * I + col;
      });
      consumer_sync();
    }
    if (a_pool != nullptr) {  // null when the backward recomputes z only
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 32; i += 2) {  // elements i (gate) and i + 32 (up) share row and column
          const float g0 = round_bf16(acc[h][i]), u0 = round_bf16(acc[h][i + 32]);
          const float g1 = round_bf16(acc[h][i + 1]), u1 = round_bf16(acc[h][i + 33]);
          stage_pair(staging, h, i, silu_f(g0) * u0, silu_f(g1) * u1);
        }
      consumer_sync();
      copy_out_bf16(staging, 64, [&](int r, int cc) { return a_pool + (pool_row0 + r) * I + tile.n * 64 + cc * 8; });
    }
  } else if constexpr (kSlots) {
    // Weighted (forward) or plain (dx) expert output rows go to the source's slot [j, t].
    const int k = plan.top_k;
    const int64_t T = plan.num_tokens, N = a.n;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float w_row[2] = {1.0f, 1.0f};
      if constexpr (M == GemmMode::kDown) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int src = plan.row_src[pool_row0 + acc_row(h, 2 * q)];
          w_row[q] = src >= 0 ? a.topk_weights[src] : 0.0f;
        }
      }
#pragma unroll
      for (int i = 0; i < 64; i += 2) {
        const float w = w_row[(i >> 1) & 1];
        stage_pair(staging, h, i, w * acc[h][i], w * acc[h][i + 1]);
      }
    }
    consumer_sync();
    auto* slots = static_cast<__nv_bfloat16*>(a.out0);
    copy_out_bf16(staging, kBlockN, [&](int r, int cc) -> __nv_bfloat16* {
      const int src = sm.tile_src[r];
      if (src < 0) return nullptr;
      const int64_t slot_row = static_cast<int64_t>(src % k) * T + src / k;
      return slots + slot_row * N + tile.n * kBlockN + cc * 8;
    });
  } else if constexpr (M == GemmMode::kDownGrad) {
    // acc = ga for a-columns 128n + c. With (g, u) from the saved z (in the
    // two z stages):
    //   a = bf16(silu(g) u); d topk_w partial = sum_c ga a; da = w ga;
    //   dz = [bf16(da u silu'(g)), bf16(da silu(g))]; wa = bf16(w a) (dW2 operand).
    // Outputs go straight from registers (a quad writes 16 contiguous bytes
    // of a row), so the z stages return to the producer as soon as they are
    // read and the other consumer's main loop keeps its pipeline depth.
    auto* dz = static_cast<__nv_bfloat16*>(a.out0);
    auto* wa = static_cast<__nv_bfloat16*>(a.out1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float w_row[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int src = plan.row_src[pool_row0 + acc_row(h, 2 * q)];
        w_row[q] = src >= 0 ? a.topk_weights[src] : 0.0f;
      }
      float dw[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 64; i += 2) {
        const int row = acc_row(h, i), col = acc_col(i), q = (i >> 1) & 1;
        const uint32_t off = swizzled_offset(row, col);
        const __nv_bfloat162 g2 = *reinterpret_cast<const __nv_bfloat162*>(sm.z[0] + off);
        const __nv_bfloat162 u2 = *reinterpret_cast<const __nv_bfloat162*>(sm.z[1] + off);
        float out_wa[2], out_dg[2], out_du[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float g = __bfloat162float(e ? g2.y : g2.x), u = __bfloat162float(e ? u2.y : u2.x);
          const float sg = 1.0f / (1.0f + __expf(-g)), silu = g * sg;
          const float ga = acc[h][i + e], w = w_row[q];
          const float av = round_bf16(silu * u);
          dw[q] += ga * av;
          out_wa[e] = w * av;
          out_dg[e] = (w * ga) * u * (sg * (1.0f + g * (1.0f - sg)));
          out_du[e] = (w * ga) * silu;
        }
        const int64_t prow = pool_row0 + row, c = static_cast<int64_t>(tile.n) * kBlockN + col;
        *reinterpret_cast<__nv_bfloat162*>(wa + prow * I + c) = __floats2bfloat162_rn(out_wa[0], out_wa[1]);
        *reinterpret_cast<__nv_bfloat162*>(dz + prow * 2 * I + c) = __floats2bfloat162_rn(out_dg[0], out_dg[1]);
        *reinterpret_cast<__nv_bfloat162*>(dz + prow * 2 * I + I + c) = __floats2bfloat162_rn(out_du[0], out_du[1]);
      }
      // Row sums over this thread's columns, then over the quad: fixed order.
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        dw[q] += __shfl_xor_sync(0xFFFFFFFFu, dw[q], 1);
        dw[q] += __shfl_xor_sync(0xFFFFFFFFu, dw[q], 2);
        if ((threadIdx.x & 3) == 0) a.dw_partial[(pool_row0 + acc_row(h, 2 * q)) * p.n_tiles + tile.n] = dw[q];
      }
    }
    __syncwarp();  // every lane of this warp has read its z elements
    if ((threadIdx.x & 31) == 0) {
      mbar_arrive(sm.z_empty[0]);
      mbar_arrive(sm.z_empty[1]);
    }
  } else {  // kWeightGrad: dW[e][128m + r][128n + c], straight from registers
    // A quad's four threads hold 8 adjacent columns of a row: 32-byte (fp32)
    // or 16-byte (bf16) contiguous pieces per row.
    const int64_t N = a.n;
    const int64_t base = static_cast<int64_t>(tile.expert) * a.m * N + static_cast<int64_t>(tile.m) * kBlockM * N +
                         static_cast<int64_t>(tile.n) * kBlockN;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 64; i += 2) {
        const int64_t off = base + static_cast<int64_t>(acc_row(h, i)) * N + acc_col(i);
        float2 v = make_float2(acc[h][i], acc[h][i + 1]);
        if (a.out_f32) {
          auto* dst = reinterpret_cast<float2*>(static_cast<float*>(a.out0) + off);
          if (a.accumulate) {
            const float2 old = *dst;
            v.x += old.x, v.y += old.y;
          }
          *dst = v;
        } else {
          *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(a.out0) + off) = __floats2bfloat162_rn(v.x, v.y);
        }
      }
  }
}

template <GemmMode M>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_z, const __grid_constant__ KernelParams p) {
  using Tr = ModeTraits<M>;
  constexpr int S = Tr::kStages;
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment: the 128B swizzle pattern repeats every 1024 bytes.
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* staging_base = smem + S * kStageBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(staging_base + 2 * Tr::kStagingBytes);
  uint64_t* empty = full + S;
  uint64_t* order = empty + S;  // order[c]: the other consumer has finished waiting for its tile's stages
  auto* tile_src_base = reinterpret_cast<int32_t*>(order + 2);
  // Set by the first thread whose wait gives up; the others then give up too.
  auto* abort_flag = reinterpret_cast<uint32_t*>(tile_src_base + 2 * kBlockM);

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 4);  // one arrival per warp of the consumer that owns the stage's tile
    }
    mbar_init(&order[0], 1);
    mbar_init(&order[1], 1);
    *abort_flag = 0u;
    fence_barrier_init();
  }
  __syncthreads();

  const int tiles = num_tiles<M>(p);
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    // Producer: one thread issues all TMA loads, tile after tile, in the order
    // the consumers take them. It returns early when a wait gives up or at
    // the fault-injection point (debug_stall_at).
    if (threadIdx.x == 0) {
      const int64_t stall_at = p.args.debug_stall_at;
      tma_prefetch_descriptor(&map_a);
      tma_prefetch_descriptor(&map_b);
      if constexpr (Tr::kZStages > 0) tma_prefetch_descriptor(&map_z);
      uint32_t it = 0;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const Tile tile = tile_at<M>(p, t);
        for (int kb = 0; kb < tile.k_blocks; ++kb, ++it) {
          const int s = static_cast<int>(it % S);
          if (static_cast<int64_t>(it) == stall_at) return;
          if (!wait_phase<M>(p, abort_flag, &empty[s], ((it / S) & 1) ^ 1, kBarrierEmpty, it)) return;
          mbar_arrive_expect_tx(&full[s], kStageBytes);
          uint8_t* stage = smem + s * kStageBytes;
          load_stage<M>(p, &map_a, &map_b, tile, kb, stage, stage + kTileBytesA, &full[s]);
        }
        for (int half = 0; half < Tr::kZStages; ++half, ++it) {
          const int s = static_cast<int>(it % S);
          if (static_cast<int64_t>(it) == stall_at) return;
          if (!wait_phase<M>(p, abort_flag, &empty[s], ((it / S) & 1) ^ 1, kBarrierEmpty, it)) return;
          mbar_arrive_expect_tx(&full[s], kStageBytes);
          load_z_stage(p, &map_z, tile, half, smem + s * kStageBytes, &full[s]);
        }
      }
    }
    return;
  }

  // Consumers: warpgroup wg takes the CTA's tiles j with j % 2 == wg - 1 and
  // computes all 128 rows of each (acc[h]: rows [64h, 64h + 64)). Both walk
  // every tile to keep the shared stage counter `it` in step with the producer.
  //
  // Main loops run in tile order, one consumer at a time (order barriers):
  // a consumer starts waiting for its tile's stages only after the other has
  // waited for all stages of the previous tile. Without that it could poll a
  // stage whose previous use (it - S) has not completed yet, and a parity wait
  // cannot tell those two phases apart (it would read the old contents).
  setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 1;
  const bool warp_leader = (threadIdx.x & 31) == 0;
  const EpilogueSmem sm_base{reinterpret_cast<__nv_bfloat16*>(staging_base + cw * Tr::kStagingBytes),
                             tile_src_base + cw * kBlockM, {nullptr, nullptr}, {nullptr, nullptr}};
  uint32_t it = 0;
  float acc[2][64];
  int j = 0, mine = 0;  // mine: tiles this consumer has taken
  for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++j) {
    const Tile tile = tile_at<M>(p, t);
    if ((j & 1) != cw) {
      it += tile.k_blocks + Tr::kZStages;
      continue;
    }
    // Consumer 0's n-th tile follows consumer 1's (n-1)-th: phase n - 1 of
    // order[0]; consumer 1's n-th follows consumer 0's n-th: phase n of order[1].
    if (cw == 1 || mine > 0) {
      if (!wait_phase<M>(p, abort_flag, &order[cw], static_cast<uint32_t>(cw == 0 ? mine - 1 : mine) & 1, kBarrierOrder,
                         it))
        return;
    }
    ++mine;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    for (int kb = 0; kb < tile.k_blocks; ++kb, ++it) {
      const int s = static_cast<int>(it % S);
      if (!wait_phase<M>(p, abort_flag, &full[s], (it / S) & 1, kBarrierFull, it)) {
        wgmma_wait<0>();  // retire the previous k-block's group before leaving
        return;
      }
      const uint8_t* sa = smem + s * kStageBytes;
      const uint8_t* sb = sa + kTileBytesA;
      // Between here and the wait<0> after the loop, nothing but wgmma touches
      // the accumulators (the fences are compiler-only: no instruction).
      fence_accumulators(acc[0]);
      fence_accumulators(acc[1]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        uint64_t db;
        if constexpr (Tr::kBMnMajor) {
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
          wgmma_m64n128k16_bf16<Tr::kAMnMajor ? 1 : 0, Tr::kBMnMajor ? 1 : 0>(acc[h], da, db, 1);
        }
      }
      wgmma_commit();
      // Keep this k-block's group in flight while the next one is waited for
      // and issued: retiring down to one pending group proves the previous
      // k-block's group done, so its stage (not this one) goes back.
      wgmma_wait<1>();
      if (kb > 0 && warp_leader) mbar_arrive(&empty[(it + S - 1) % S]);
    }
    wgmma_wait<0>();
    fence_accumulators(acc[0]);
    fence_accumulators(acc[1]);
    if (tile.k_blocks > 0 && warp_leader) mbar_arrive(&empty[(it + S - 1) % S]);
    EpilogueSmem sm = sm_base;
#pragma unroll
    for (int half = 0; half < Tr::kZStages; ++half) {
      const int s = static_cast<int>((it + half) % S);
      if (!wait_phase<M>(p, abort_flag, &full[s], ((it + half) / S) & 1, kBarrierFull, it + half)) return;
      sm.z[half] = smem + s * kStageBytes;
      sm.z_empty[half] = &empty[s];  // the epilogue releases the stage once it has read it
    }
    if ((threadIdx.x & 127) == 0) mbar_arrive(&order[cw ^ 1]);  // the other consumer may start its main loop
    epilogue<M>(p, tile, acc, sm);
    it += Tr::kZStages;
  }
}


template <GemmMode M>
Status launch_mode(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_z,
                   const KernelParams& params, int grid, cudaStream_t stream) {
  using Tr = ModeTraits<M>;
  cudaError_t err = cudaFuncSetAttribute(grouped_gemm_kernel<M>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Tr::kSmemBytes);
  if (err == cudaSuccess) {
    grouped_gemm_kernel<M><<<grid, kThreads, Tr::kSmemBytes, stream>>>(map_a, map_b, map_z, params);
    err = cudaGetLastError();
  }
  return cuda_status("grouped GEMM launch", err);
}

}  // namespace

Status launch_grouped_gemm(const GroupedGemmArgs& args, int num_sms, cudaStream_t stream) {
  if (args.n % kBlockN != 0 && args.mode != GemmMode::kGateUp)
    return internal_error("grouped GEMM: N = " + std::to_string(args.n) + " is not a multiple of 128");
  if (args.k % kBlockK != 0) return internal_error("grouped GEMM: K is not a multiple of 64");
  KernelParams p;
  p.args = args;
  // kGateUp: each 128-column tile holds 64 gate and the matching 64 up columns.
  p.n_tiles = static_cast<int>(args.mode == GemmMode::kGateUp ? args.n / 64 : args.n / kBlockN);
  p.m_tiles = static_cast<int>(args.m / kBlockM);
  // Every operand is loaded as 64 x 64 boxes; the mode decides what the two
  // box dimensions mean (K-major: rows x K, MN-major: K x MN).
  CUtensorMap map_a, map_b;
  MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(args.a, args.a_rows, args.a_cols, &map_a));
  MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(args.b, args.b_rows, args.b_cols, &map_b));
  CUtensorMap map_z = map_a;  // read only by kDownGrad: the saved z pool [C, 2I]
  if (args.mode == GemmMode::kDownGrad)
    MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(args.z_pool, args.a_rows, 2 * args.intermediate, &map_z));
  const int grid = num_sms;
  switch (args.mode) {
    case GemmMode::kGateUp: return launch_mode<GemmMode::kGateUp>(map_a, map_b, map_z, p, grid, stream);
    case GemmMode::kDown: return launch_mode<GemmMode::kDown>(map_a, map_b, map_z, p, grid, stream);
    case GemmMode::kDownGrad: return launch_mode<GemmMode::kDownGrad>(map_a, map_b, map_z, p, grid, stream);
    case GemmMode::kGateUpGrad: return launch_mode<GemmMode::kGateUpGrad>(map_a, map_b, map_z, p, grid, stream);
    case GemmMode::kWeightGrad: return launch_mode<GemmMode::kWeightGrad>(map_a, map_b, map_z, p, grid, stream);
  }
  return internal_error("grouped GEMM: unknown mode");
}

}  // namespace megamoe::cuda
