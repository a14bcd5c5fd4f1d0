// kGateUp's epilogue: z = [g | u] (kept for the backward) and a = silu(g) u,
// both bf16, to their pools. Device code; included by epilogues.cuh.
#pragma once

#include "cuda/gemm/epilogue_common.cuh"

namespace megamoe::cuda::engine {

// FP8 (128 x 128 tiles): acc columns [0, 64) are gate g, [64, 128) up u, both
// for a-columns 64n + c. Staged a row half at a time (the FP8 kernels' half
// staging tile), stored with 16-byte stores.
struct Fp8GateUpEpilogue {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& sm, int /*cw*/) const {
    const GroupedGemmArgs& a = p.args;
    __nv_bfloat16* staging = sm.staging;
    const int64_t I = a.intermediate;
    const int64_t pool_row0 = static_cast<int64_t>(tile.m) * kBlockM;
    begin_epilogue();
    auto* z_pool = static_cast<__nv_bfloat16*>(a.out.z);
    auto* a_pool = static_cast<__nv_bfloat16*>(a.out.a);
    constexpr int kParts = 2, kRows = kBlockM / kParts;
    if (z_pool != nullptr) {
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
#pragma unroll
        for (int i = 0; i < 64; i += 2) stage_pair(staging, 0, i, acc[part][i], acc[part][i + 1]);
        store_rows<kRows, kBlockN, 64, true>(staging, [&](int r, int s) {  // s = 0: gate columns, 1: up columns
          return z_pool + (pool_row0 + part * kRows + r) * 2 * I + s * I + tile.n * 64;
        });
        staging_free();
      }
    }
    if (a_pool != nullptr) {  // null when the backward recomputes z only
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
#pragma unroll
        for (int i = 0; i < 32; i += 2) {  // elements i (gate) and i + 32 (up) share row and column
          const float g0 = round_bf16(acc[part][i]), u0 = round_bf16(acc[part][i + 32]);
          const float g1 = round_bf16(acc[part][i + 1]), u1 = round_bf16(acc[part][i + 33]);
          stage_pair(staging, 0, i, silu_f(g0) * u0, silu_f(g1) * u1);
        }
        store_rows<kRows, 64, 64, true>(staging, [&](int r, int) {
          return a_pool + (pool_row0 + part * kRows + r) * I + tile.n * 64;
        });
        if (part + 1 < kParts) staging_free();
      }
    }
    return true;
  }
};

// bf16 in 128 x 256 tiles: consumer cw holds rows [64 cw, 64 cw + 64) of the
// tile, acc[0] their 128 gate columns and acc[1] the matching 128 up columns
// (a-columns 128 n + c: register i of both is the same row and column). z's
// gate half, its up half and a = silu(g) u (the values and roundings of the
// FP8 epilogue above) pass one after another through the consumer's two
// 128B-swizzled 64 x 64 boxes (HalfTilePlaces: a 64-row x 128-column part)
// and leave by TMA stores (out_map[0]: z [C, 2I], out_map[1]: a [C, I]). One
// thread issues the stores and waits for their reads before the buffer is
// written again (the next part, or the next tile's epilogue).
struct WideGateUpEpilogue {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& ctx, int cw) const {
    const GroupedGemmArgs& a = p.args;
    const int I = static_cast<int>(a.intermediate);
    const int col0 = tile.n * 128;
    const BoxStores out(ctx.boxes, tile.m * kBlockM + 64 * cw);
    auto gate = [&](int i) { return acc[0][i]; };
    auto up = [&](int i) { return acc[1][i]; };
    if (a.out.z != nullptr) {  // z: gate columns at 128 n, up columns I further on
      out.begin();
      out.stage(0, gate);
      out.publish();
      out.store(ctx.out_map[0], 0, col0);
      out.begin();
      out.stage(0, up);
      out.publish();
      out.store(ctx.out_map[0], 0, I + col0);
    }
    if (a.out.a != nullptr) {  // null when the backward recomputes z only
      out.begin();
      out.stage(0, [&](int i) { return silu_f(round_bf16(acc[0][i])) * round_bf16(acc[1][i]); });
      out.publish();
      out.store(ctx.out_map[1], 0, col0);
    }
    return true;
  }
};

}  // namespace megamoe::cuda::engine
