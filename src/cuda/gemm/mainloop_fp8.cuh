// The FP8 main loop of one tile (e4m3 operands, both K-major: kGateUp,
// kDown; kDownGrad and kGateUpGrad with B transposed; kWeightGrad with both
// transposed). Device code; included by kernel.cuh.
//
// Each 128-long k-block is summed in two halves (h: rows [64h, 64h + 64),
// all 128 columns), each by four m64n128k32 wgmmas into a 64-register
// temporary (scale_d = 0 starts it afresh), then added to acc[h] times
// a_scale(row) * b_scale(column block): the recipe's promotion every 128 K.
// The wait before each promotion leaves this warpgroup's tensor-core slots
// idle; on split rings the other consumer's main loop fills them (n64
// quarters with two alternating temporaries, pipelined inside one
// warpgroup, measured no faster on split rings and 5-11% slower in
// kWeightGrad). kGateUp's column halves are its gate and up columns (two
// scale blocks of B), the other modes' 128 columns one block. B's scales:
// [b.rows / 128, k / 128] for B as given (kGateUp, kDown); with B
// transposed, the untransposed weights' blocks, [E, k / 128, n / 128] (the
// block quantizer's layout, whose transposed copy is this B). kWeightGrad
// scales A^T per row and B^T per column of each k-block, both from the
// stage's scale-ring slot (the producer's bulk loads), [A 128 | B 128].
#pragma once

#include "cuda/gemm/epilogue_common.cuh"
#include "cuda/gemm/kernel_spec.h"
#include "cuda/gemm/pipeline.cuh"
#include "cuda/gemm/tile_scheduler.cuh"

namespace megamoe::cuda::engine {

// false: a wait gave up (reported); the stage's wgmmas are retired.
template <typename Spec, typename Ring, typename State, typename Release>
__device__ __forceinline__ bool fp8_main_loop(const KernelParams& p, const Tile& tile, const Ring& ring,
                                              const BoundedWait& waits, State& ps, float (&acc)[2][64],
                                              Release&& release) {
  constexpr GemmMode M = Spec::kMode;
  constexpr bool kWgrad = M == GemmMode::kWeightGrad;
  constexpr bool kBT = Spec::kBTransposed;
  static_assert(kAccPerThread + 64 + 32 <= Spec::kRegs.consumer, "FP8's promotion temporary does not fit the consumer");
  const int kbs = static_cast<int>(p.args.k / kBlockKFp8);  // scale columns (M-grouped modes)
  // This thread's accumulator rows (acc_row): r and r + 8 of each half.
  const int r0 = tile.m * kBlockM + acc_row(0, 0);
  // Its A scales (M-grouped): a.scales[sa + (64 h + 8 q) * kbs + kb]. Offsets,
  // not pointers (registers: the consumers have 232, the accumulators take 192).
  const int sa = r0 * kbs;
  // B's 128-row scale blocks of this tile's columns: kGateUp's 64 gate and 64
  // up columns sit in two blocks, kDown's 128 columns in one.
  // b.scales[sb + kb * sb_step]: the scale of k-block kb for the first 64
  // columns, sb_up further on for the other 64 (kGateUp's up columns, I / 128
  // blocks on: FP8 kGateUp needs I % 128 == 0, select_kernel checks).
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
  // The global scales of k-block kb, loaded one k-block ahead: a load issued
  // just before its k-block's wgmmas came back after them, and the
  // promotion's multiply waited for it (FP8 kDownGrad: 9% of its stall
  // samples on that FMUL). b[c]: column block c's; a[h][q]: row (h, q)'s.
  struct Scales {
    float b[2] = {1.0f, 1.0f};
    float a[2][2] = {{1.0f, 1.0f}, {1.0f, 1.0f}};
  };
  auto load_scales = [&](int kb) {
    Scales s;
    if constexpr (!kWgrad) {
      s.b[0] = __ldg(p.args.b.scales + sb + kb * sb_step), s.b[1] = __ldg(p.args.b.scales + sb + sb_up + kb * sb_step);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 2; ++q) s.a[h][q] = __ldg(p.args.a.scales + sa + (64 * h + 8 * q) * kbs + kb);
    }
    return s;
  };
  float tmp[64];
  Scales cur;  // k-block kb's
  if (tile.k_blocks > 0) cur = load_scales(0);
  for (int kb = 0; kb < tile.k_blocks; ++kb, ++ps) {
    // k-block kb + 1's (kb's again on the last: a valid address, no branch).
    const Scales next = load_scales(kb + 1 < tile.k_blocks ? kb + 1 : kb);
    if (!ring.consumer_wait(waits, ps)) return false;
    const float* stage_scales = nullptr;  // kWeightGrad: the stage's scale-ring slot
    if constexpr (kWgrad) {  // the tile's row r's scale at stage_scales[r]
      stage_scales = ring.stage_scales(ps.stage());
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 2; ++q) cur.a[h][q] = stage_scales[acc_row(h, 2 * q)];
    }
    const uint8_t* stage_a = ring.stage(ps.stage());
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
    release(ps.stage());  // with a scale ring: every lane, after its own scale reads (see the kernel's release)
    cur = next;  // the ring's row scales are read again from the next stage
  }
  return true;
}

}  // namespace megamoe::cuda::engine
