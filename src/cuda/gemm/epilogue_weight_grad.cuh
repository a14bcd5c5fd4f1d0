// kWeightGrad's epilogue: dW[e] tiles straight from registers, fp32
// (overwritten or added to) or bf16. Device code; included by epilogues.cuh.
#pragma once

#include "cuda/gemm/epilogue_common.cuh"

namespace megamoe::cuda::engine {

// kWeightGrad: dW[e][128m + r][128n + c], straight from registers. kWide
// (128 x 256 tiles): consumer cw holds rows [64 cw, 64 cw + 64), acc[h]
// their columns [128h, 128h + 128) of dW[e][..][256n..]; else acc[h] holds
// rows [64h, 64h + 64) of the tile's 128 columns.
template <bool kWide>
struct WeightGradEpilogue {
  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& /*ctx*/, int cw) const {
    const GroupedGemmArgs& a = p.args;
    begin_epilogue();
    // A quad's lane t holds columns 8j + 2t, + 1 of its rows (j = 0..15).
    // Lanes t and t ^ 1 swap one column pair, so that each holds four
    // adjacent columns: even t those of j = 2jj (its own pair, then its
    // partner's), odd t those of j = 2jj + 1 (its partner's, then its own).
    // A warp's store then covers whole 32-byte sectors: 8 bytes a lane in
    // bf16 (a pair a lane wrote half sectors: Nsight Compute measured 50%
    // excess sectors in FP8 dW2) and 16 in fp32, with half the store
    // instructions (dW2's stores waited on the LSU queue, lg throttle).
    // Each of this thread's four rows (h, q) gets one pointer, its stores at
    // immediate offsets 16 jj from it. (With the address built per store, a
    // store took ~18 instructions in the SASS.)
    const bool odd = (threadIdx.x & 1) != 0;
    const int64_t N = a.n;
    const int64_t base = static_cast<int64_t>(tile.expert) * a.m * N + static_cast<int64_t>(tile.m) * kBlockM * N +
                         static_cast<int64_t>(tile.n) * (kWide ? 256 : kBlockN) + acc_col(0) + (odd ? 6 : 0);
    // Accumulator half h's row q and first column in the tile.
    auto row_of = [&](int h, int q) { return kWide ? 64 * cw + acc_row(0, 2 * q) : acc_row(h, 2 * q); };
    auto col_of = [&](int h) { return kWide ? 128 * h : 0; };
    // store_quad(dst, lo, hi): lo = columns [c, c + 2), hi = [c + 2, c + 4) of dst's row.
    auto store_tile = [&](auto* out, auto pack, auto store_quad) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          auto* row = out + base + static_cast<int64_t>(row_of(h, q)) * N + col_of(h);
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const int i0 = 8 * jj + 2 * q, i1 = i0 + 4;  // j = 2jj and 2jj + 1
            const auto v0 = pack(acc[h][i0], acc[h][i0 + 1]);
            const auto v1 = pack(acc[h][i1], acc[h][i1 + 1]);
            const auto got = shfl_xor1(odd ? v0 : v1);
            store_quad(row + 16 * jj, odd ? got : v0, odd ? v1 : got);
          }
        }
    };
    const auto pair_f32 = [](float x, float y) { return make_float2(x, y); };
    if (a.out.dw_f32 && a.out.accumulate) {
      store_tile(static_cast<float*>(a.out.dw), pair_f32, [](float* d, float2 lo, float2 hi) {
        const float4 old = *reinterpret_cast<const float4*>(d);
        *reinterpret_cast<float4*>(d) = make_float4(lo.x + old.x, lo.y + old.y, hi.x + old.z, hi.y + old.w);
      });
    } else if (a.out.dw_f32) {
      store_tile(static_cast<float*>(a.out.dw), pair_f32, [](float* d, float2 lo, float2 hi) {
        *reinterpret_cast<float4*>(d) = make_float4(lo.x, lo.y, hi.x, hi.y);
      });
    } else {
      store_tile(
          static_cast<__nv_bfloat16*>(a.out.dw),
          [](float x, float y) {
            const __nv_bfloat162 b = __floats2bfloat162_rn(x, y);
            return *reinterpret_cast<const uint32_t*>(&b);
          },
          [](__nv_bfloat16* d, uint32_t lo, uint32_t hi) { *reinterpret_cast<uint2*>(d) = make_uint2(lo, hi); });
    }
    return true;
  }

 private:
  // The partner lane's value (t ^ 1 of the quad), the whole warp taking part.
  __device__ __forceinline__ static uint32_t shfl_xor1(uint32_t v) { return __shfl_xor_sync(0xFFFFFFFFu, v, 1); }
  __device__ __forceinline__ static float2 shfl_xor1(float2 v) {
    return make_float2(__shfl_xor_sync(0xFFFFFFFFu, v.x, 1), __shfl_xor_sync(0xFFFFFFFFu, v.y, 1));
  }
};

}  // namespace megamoe::cuda::engine
