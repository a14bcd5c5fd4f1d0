// The grouped GEMM kernel: persistent, warp-specialised, one CTA an SM.
// Warpgroup 0 is the producer (TMA loads into a ring of shared-memory stages)
// and, in the bf16 kernels, the side jobs; warpgroups 1 and 2 are the
// consumers. On one shared ring the consumers take the CTA's tiles in turn
// ("ping-pong"): while one runs a tile's wgmma main loop the other runs the
// previous tile's fused epilogue, so the tensor cores do not wait for
// epilogues. FP8 kernels run on split rings (one per consumer, main loops at
// the same time); bf16 128 x 256 tiles put both consumers on every tile.
//
// The parts: kernel_spec.h (the instantiation's shapes and shared memory),
// pipeline.cuh (the stage ring, order barriers, bounded waits),
// tile_scheduler.cuh (which tiles, in what order), producer.cuh,
// mainloop_bf16.cuh, mainloop_fp8.cuh, epilogues.cuh (one per mode),
// side_jobs.cuh. Device code; included by launch.cu.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include "cuda/gemm/epilogues.cuh"
#include "cuda/gemm/kernel_spec.h"
#include "cuda/gemm/mainloop_bf16.cuh"
#include "cuda/gemm/mainloop_fp8.cuh"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/gemm/producer.cuh"
#include "cuda/gemm/side_jobs.cuh"
#include "cuda/gemm/tile_scheduler.cuh"
#include "cuda/ptx/sm90.cuh"

namespace megamoe::cuda::engine {

// What each thread of the CTA does. The producer warpgroup first gives
// registers back (setmaxnreg, warpgroup-wide); then thread 0 (and on split
// rings thread 32, ring 1's) issues the loads, warps 1-3 of the bf16 kernels
// run the side jobs (not kDown's: none there), the rest of it is idle.
enum class WarpRole { kProducer, kSideJobs, kIdle, kConsumer };

template <typename Spec>
__device__ __forceinline__ WarpRole warp_role() {
  constexpr bool kSideJobs = !Spec::kFp8 && Spec::kMode != GemmMode::kDown;
  const int t = static_cast<int>(threadIdx.x);
  if (t >= 128) return WarpRole::kConsumer;
  if (t == 0 || (Spec::kSplitRings && t == 32)) return WarpRole::kProducer;
  return kSideJobs && t >= 32 ? WarpRole::kSideJobs : WarpRole::kIdle;
}

// The CTA's shared memory: 1024-byte aligned (the 128B swizzle pattern
// repeats every 1024 bytes). Rounded as a shared-window address and
// converted back, every pointer derived from it stays known to the compiler
// as shared memory, so that their accesses compile to LDS / STS; rounded
// through uintptr_t they were generic LD.E / ST.E (staging, row_dst, row_w).
// kDownGrad keeps the integer form: its epilogue already addresses the z
// chunk through shared addresses, and the shared form cost its bf16 kernel a
// 4-byte spill.
template <typename Spec>
__device__ __forceinline__ SharedStorage<Spec>& shared_storage(uint8_t* raw) {
  uint8_t* base = Spec::kMode == GemmMode::kDownGrad
                      ? reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023})
                      : static_cast<uint8_t*>(__cvta_shared_to_generic((smem_u32(raw) + 1023u) & ~1023u));
  return *reinterpret_cast<SharedStorage<Spec>*>(base);
}

// Consumers. Shared ring: consumer cw takes the CTA's tiles j with j % 2 ==
// cw (acc[h]: rows [64h, 64h + 64)); both walk every tile to keep the
// pipeline state in step with the producer, and main loops run in tile
// order, one consumer at a time (OrderBarriers). Split rings: each walks its
// own tiles and ring (FP8 kGateUp: column tile 2j + cw of each unit). Wide
// tiles: both take every tile, at once, consumer cw its rows [64cw, 64cw +
// 64); no order barriers (each stage is freed by both, so neither can poll a
// stage's next phase early).
template <typename Spec, typename Ring>
__device__ __forceinline__ void run_consumer(const KernelParams& p, const TensorMaps& maps, SharedStorage<Spec>& ss,
                                             const Ring& ring, const BoundedWait& waits,
                                             const TileScheduler<Spec>& scheduler, int tiles) {
  constexpr int R = Spec::kRingStages;
  constexpr bool kTakeTurns = !Spec::kSplitRings && !Spec::kWide;
  constexpr int kRowRows = Spec::kRowDstRows;
  const int cw = static_cast<int>(threadIdx.x / 128) - 1;
  const bool warp_leader = (threadIdx.x & 31) == 0;
  const auto my_ring = ring.template slice<R>(Spec::kSplitRings ? cw * R : 0);
  const OrderBarriers order{ss.order};
  // A warp (with a scale ring: every lane, after its own scale reads) gives
  // stage s of its ring back. A warp leader's arrival after __syncwarp would
  // do under the PTX memory model, but compute-sanitizer racecheck does not
  // see it (hazards on the scale reads), nor a named barrier of the
  // warpgroup before 4 leader arrivals.
  auto release = [&](int s) {
    if (!Spec::kScaleRing && !warp_leader) return;
    my_ring.consumer_release(s);
  };
  uint8_t* my_buffer = nullptr;
  if constexpr (Spec::kEpilogueBytes > 0) my_buffer = ss.epilogue[cw];
  __nv_bfloat16** row_dst = nullptr;
  float* row_w = nullptr;
  if constexpr (kRowRows > 0) row_dst = reinterpret_cast<__nv_bfloat16**>(ss.row_dst) + cw * kRowRows;
  if constexpr (Spec::kMode == GemmMode::kDown) row_w = ss.row_w + cw * kRowRows;
  EpilogueContext ctx{reinterpret_cast<__nv_bfloat16*>(my_buffer),
                      row_dst,
                      row_w,
                      my_buffer,
                      &ss.z_full[cw],
                      0,
                      -1,
                      &waits,
                      maps.z,
                      {maps.out0, maps.out1}};
  const bool epilogues = !p.skip_epilogue;
  // kDownGrad: the first z chunk of this consumer's first tile loads during its main loop.
  if constexpr (Spec::kZChunks) {
    const int first = static_cast<int>(blockIdx.x) + cw * static_cast<int>(gridDim.x);
    if (epilogues && first < tiles && (threadIdx.x & 127) == 0) load_z_chunk(p, ctx, z_piece(scheduler.tile(first, cw), 0));
  }
  const Walk walk = scheduler.walk(cw, tiles);
  PipelineState<R> ps;
  float acc[2][64];
  int j = 0, mine = 0;  // mine: tiles this consumer has taken
  for (int t = walk.first; t < walk.end; t += walk.step, ++j) {
    const Tile tile = scheduler.tile(t, cw);
    if constexpr (kTakeTurns) {
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
    // The slot modes' row source (EpilogueContext::my_src), read before the
    // main loop so that the epilogue does not start by waiting for it.
    // (Wide: the consumer's 64 rows; threads 64-127 load them again.)
    if constexpr (kRowRows > 0) {
      const int r = Spec::kWide ? 64 * cw + (threadIdx.x & 63) : (threadIdx.x & 127);
      if (epilogues) ctx.my_src = p.args.plan.row_src[static_cast<int64_t>(tile.m) * kBlockM + r];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    if constexpr (Spec::kFp8) {
      if (!fp8_main_loop<Spec>(p, tile, my_ring, waits, ps, acc, release)) {
        bulk_wait_group<0>();
        return;
      }
    } else {
      if (!bf16_main_loop<Spec>(tile, my_ring, waits, ps, acc, cw, release)) return;
    }
    if (kTakeTurns && (threadIdx.x & 127) == 0) order.pass_turn(cw);  // the other consumer may start its main loop
    if (!epilogues) continue;
    if (!Epilogue<Spec>{}(p, tile, acc, ctx, cw)) {
      bulk_wait_group<0>();
      return;
    }
    // kDownGrad: the buffer is free again (the storer, this same thread, saw
    // the last TMA store read it); the next tile's first z chunk loads now.
    if constexpr (Spec::kZChunks) {
      const int next = t + 2 * static_cast<int>(gridDim.x);
      if (next < tiles && (threadIdx.x & 127) == 0) load_z_chunk(p, ctx, z_piece(scheduler.tile(next, cw), 0));
    }
  }
  // The epilogues' bulk and TMA stores still read shared memory; let them land before the kernel ends.
  if constexpr (Spec::kZChunks || Spec::kStagedRows) bulk_wait_group<0>();
}

template <typename Spec>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_z, const __grid_constant__ CUtensorMap map_out0,
                        const __grid_constant__ CUtensorMap map_out1, const __grid_constant__ KernelParams p) {
  constexpr int S = Spec::kStages;
  extern __shared__ uint8_t smem_raw[];
  SharedStorage<Spec>& ss = shared_storage<Spec>(smem_raw);
  float* scales = nullptr;
  if constexpr (Spec::kScaleRing) scales = ss.scale_ring;
  const StageRing<S, Spec::kStageBytes, Spec::kScaleRing> ring{ss.full, ss.empty, &ss.stages[0][0], scales};
  const BoundedWait waits{p.args.errors, &ss.cta_state, kernel_id(Spec::kKey), Spec::kHoldRows};
  const TileScheduler<Spec> scheduler{p};
  const TensorMaps maps{&map_a, &map_b, &map_z, &map_out0, &map_out1};
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&ss.full[s], 1);
      // one arrival per warp (per lane with a scale ring) of the consumer(s) that read the stage
      mbar_init(&ss.empty[s], Spec::kScaleRing ? 128 : Spec::kWide ? 8 : 4);
    }
    for (int c = 0; c < 2; ++c) {
      mbar_init(&ss.order[c], 1);
      mbar_init(&ss.z_full[c], 1);
    }
    ss.cta_state = 0u;
    fence_barrier_init();
  }
  __syncthreads();
  const int tiles = scheduler.num_tiles();
  // setmaxnreg is warpgroup-wide: each warpgroup runs one, before its threads part ways.
  if (threadIdx.x >= 128) {
    setmaxnreg_inc<Spec::kRegs.consumer>();
    run_consumer<Spec>(p, maps, ss, ring, waits, scheduler, tiles);
    return;
  }
  setmaxnreg_dec<Spec::kRegs.producer>();
  switch (warp_role<Spec>()) {
    case WarpRole::kProducer:
      run_producer<Spec>(p, maps, ring, waits, scheduler, tiles);
      break;
    case WarpRole::kSideJobs:
      if (p.args.side_gather.pool != nullptr) run_side_gather(p.args.side_gather);
      if constexpr (Spec::kMode == GemmMode::kWeightGrad)
        if (p.args.side_combine.out != nullptr) run_side_combine(p.args.side_combine, p.args.errors);
      break;
    case WarpRole::kIdle:
    case WarpRole::kConsumer:
      break;
  }
}

}  // namespace megamoe::cuda::engine
