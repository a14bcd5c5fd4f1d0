// kDownGrad's epilogue: from ga (the accumulators) and the forward's z, the
// SwiGLU backward, the dW2 operand and the d topk_w partials. Device code;
// included by epilogues.cuh.
#pragma once

#include "cuda/fp8/e4m3.cuh"
#include "cuda/gemm/epilogue_common.cuh"
#include "cuda/gemm/quad_transpose.h"

namespace megamoe::cuda::engine {


// kDownGrad: from ga and the saved z, the SwiGLU backward, the dW2 operand and d topk_w partials.
//   a = bf16(silu(g) u); d topk_w partial = sum_c ga a; da = w ga;
//   dz = [bf16(da u silu'(g)), bf16(da silu(g))]; wa = bf16(w a) (dW2 operand),
// with acc = ga for a-columns 128n + c. With GemmOutputs::dz_q, dz also in
// e4m3: a row's 128 dz_g (and 128 dz_u) columns of the tile are one 1 x 128
// tile of the recipe, held by the 4 lanes of a quad, so its amax is theirs.
//
// The saved z comes through the consumer's own 32 KB buffer, not the ring (z
// in ring stages stalled the producer: the ring is FIFO, so while an
// epilogue held them the other consumer's main loop starved). A row half h
// of the tile at a time, "chunk" h: its g and u columns as four boxes. A TMA
// load brings the chunk, the thread overwrites each g and u element it reads
// with dz_g and dz_u at the same swizzled place, TMA stores send them out as
// whole lines, then wa (held in registers meanwhile) goes through the g part
// the same way. Chunk 1 comes in two parts: its u boxes as soon as chunk 0's
// dz has been read out (wa only goes through the g part), its g boxes once
// wa has left; z_full expects the whole chunk from the first part on, so it
// completes when both have landed. The next tile's chunk 0 loads after the
// epilogue (the kernel issues it), whole.
enum class ZParts { kAll, kU, kG };
// Where chunk h of a tile sits: its 64 pool rows from row64 on, and its
// 128-column block cb of the I columns (dz's g block cb and u block I / 128 + cb).
struct ZPiece {
  int64_t row64;
  int cb;
};
__device__ __forceinline__ ZPiece z_piece(const Tile& tile, int h) {
  return ZPiece{static_cast<int64_t>(tile.m) * kBlockM + 64 * h, tile.n};
}
__device__ __forceinline__ void load_z_chunk(const KernelParams& p, const EpilogueContext& ctx, ZPiece pc,
                                             ZParts parts = ZParts::kAll) {
  const int I = static_cast<int>(p.args.intermediate);
  const int row = static_cast<int>(pc.row64);
  if (parts != ZParts::kG) mbar_arrive_expect_tx(ctx.z_full, kZChunkBytes);
  for (int b = parts == ZParts::kU ? 2 : 0; b < (parts == ZParts::kG ? 2 : 4); ++b)  // b: g (0, 1) or u (2, 3), column half b % 2
    tma_load_2d(ctx.boxes + b * kBoxBytes, ctx.z_map, ctx.z_full, (b < 2 ? 0 : I) + pc.cb * 128 + (b & 1) * 64,
                row);
}

struct DownGradEpilogue {
  // dz_q and dz_s of row half h from the bf16 dz this thread has just written
  // into the chunk (its own places: no barrier), with its pairs' maxima: the
  // quad's maximum is the row's over the tile's 128 g (u) columns. The same
  // amax and scale as quantize_e4m3_rows on those bf16 values, and the same
  // codes: the division with fp32 scales (the row quantizer's corrected
  // quotient gives the division's codes), with pow2 scales a multiply by the
  // exact reciprocal.
  static __device__ __forceinline__ void quantize_dz(const GroupedGemmArgs& a, ZPiece pc,
                                                     const __nv_bfloat162 (&dz_amax)[2][2], uint32_t z_g, uint32_t z_u) {
    const int64_t I = a.intermediate, groups = 2 * I / 128;
    float scale[2][2];  // [row q][g, u]
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int gu = 0; gu < 2; ++gu) {
        float amax = fp8::amax_of_pair(dz_amax[q][gu]);
        amax = fp8::fold_amax(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
        amax = fp8::fold_amax(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
        scale[q][gu] = fp8::tile_scale(amax, a.out.dz_scale);
        if ((threadIdx.x & 3) == 0) {
          const int64_t row = pc.row64 + acc_row(0, 2 * q);
          const int64_t group = gu * (I / 128) + pc.cb;  // dz's 128-column block: g's cb-th, or u's
          a.out.dz_s[row * groups + group] = scale[q][gu];
        }
      }
    if (a.out.dz_scale == Fp8Scale::kPowerOfTwo) {
      float inv[2][2];
#pragma unroll
      for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int gu = 0; gu < 2; ++gu) inv[q][gu] = __frcp_rn(scale[q][gu]);  // exact for powers of two
      store_dz_q<true>(a, pc, inv, z_g, z_u);
    } else {
      store_dz_q<false>(a, pc, scale, z_g, z_u);
    }
  }

  // The e4m3 bytes of the chunk's dz (by = the scales, or with kPow2 their
  // reciprocals), 32 columns (a 32-byte sector of each row) at a time: the
  // quad's 2-byte pieces of 4 8-column groups, transposed so that each lane
  // stores one group's 8 bytes. Not unrolled: fully unrolled (256 divisions)
  // the epilogue thrashed the instruction cache (ncu: 54% of stalls waiting
  // for an instruction; kDownGrad 3.2x slower) and its 2-byte stores wasted
  // 72% of the sectors written.
  template <bool kPow2>
  static __device__ __forceinline__ void store_dz_q(const GroupedGemmArgs& a, ZPiece pc, const float (&by)[2][2],
                                                    uint32_t z_g, uint32_t z_u) {
    const int64_t I = a.intermediate;
    const HalfTilePlaces place;
    const int quad_lane = static_cast<int>(threadIdx.x & 3);
    auto exchange = [](uint32_t v, int mask) { return __shfl_xor_sync(0xFFFFFFFFu, v, mask); };
#pragma unroll 1
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int64_t row = pc.row64 + acc_row(0, 2 * q);
#pragma unroll
        for (int gu = 0; gu < 2; ++gu) {
          uint32_t pieces[2] = {0u, 0u};  // groups 4c .. 4c + 3, two 16-bit pieces per word
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 v = __bfloat1622float2(*static_cast<const __nv_bfloat162*>(
                __cvta_shared_to_generic((gu == 0 ? z_g : z_u) + place(16 * c + 4 * j + 2 * q))));
            const uint32_t piece =
                kPow2 ? fp8::to_e4m3_pow2(v.x, by[q][gu]) | fp8::to_e4m3_pow2(v.y, by[q][gu]) << 8
                      : fp8::to_e4m3(v.x, by[q][gu]) | fp8::to_e4m3(v.y, by[q][gu]) << 8;
            pieces[j / 2] |= piece << (16 * (j % 2));
          }
          uint32_t lo, hi;
          quad_transpose16(quad_lane, pieces[0], pieces[1], exchange, lo, hi);
          const int64_t col = static_cast<int64_t>(pc.cb) * 128 + 32 * c + 8 * quad_lane;
          *reinterpret_cast<uint2*>(a.out.dz_q + row * 2 * I + gu * I + col) = make_uint2(lo, hi);
        }
      }
    }
  }

  __device__ __forceinline__ bool operator()(const KernelParams& p, const Tile& tile, float (&acc)[2][64],
                                             EpilogueContext& ctx, int /*cw*/) const {
    const GroupedGemmArgs& a = p.args;
    const DevicePlan& plan = a.plan;
    const int I = static_cast<int>(a.intermediate);
    const uint32_t z_g = smem_u32(ctx.boxes), z_u = z_g + 2 * kBoxBytes;
    const bool storer = (threadIdx.x & 127) == 0;
    auto at = [](uint32_t addr) { return static_cast<__nv_bfloat162*>(__cvta_shared_to_generic(addr)); };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const ZPiece pc = z_piece(tile, h);
      const int row = static_cast<int>(pc.row64), col0 = pc.cb * 128;
      float w_row[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int src = plan.row_src[pc.row64 + acc_row(0, 2 * q)];
        w_row[q] = src >= 0 ? a.out.topk_weights[src] : 0.0f;
      }
      if (!ctx.waits->wait(ctx.z_full, ctx.z_waits & 1u, kBarrierFull, ctx.z_waits)) return false;
      ++ctx.z_waits;
      float dw[2] = {0.0f, 0.0f};
      uint32_t wa_held[32];  // bf16x2 of wa per accumulator pair (i, i + 1)
      // dz_q: running |dz| maxima of this thread's bf16 pairs, [row q][g, u].
      const __nv_bfloat162 zero2 = __floats2bfloat162_rn(0.0f, 0.0f);
      __nv_bfloat162 dz_amax[2][2] = {{zero2, zero2}, {zero2, zero2}};
      const HalfTilePlaces place;
#pragma unroll
      for (int i = 0; i < 64; i += 2) {
        const int q = (i >> 1) & 1;
        const uint32_t off = place(i);
        const __nv_bfloat162 g2 = *at(z_g + off), u2 = *at(z_u + off);
        float out_wa[2], out_dg[2], out_du[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float g = __bfloat162float(e ? g2.y : g2.x), u = __bfloat162float(e ? u2.y : u2.x);
          const float sg = sigmoid_f(g), silu = g * sg;
          const float ga = acc[h][i + e], w = w_row[q];
          const float av = round_bf16(silu * u);
          dw[q] += ga * av;
          out_wa[e] = w * av;
          out_dg[e] = (w * ga) * u * (sg * (1.0f + g * (1.0f - sg)));
          out_du[e] = (w * ga) * silu;
        }
        const __nv_bfloat162 dg2 = __floats2bfloat162_rn(out_dg[0], out_dg[1]);
        const __nv_bfloat162 du2 = __floats2bfloat162_rn(out_du[0], out_du[1]);
        *at(z_g + off) = dg2;
        *at(z_u + off) = du2;
        dz_amax[q][0] = fp8::amax_pair(dz_amax[q][0], dg2);
        dz_amax[q][1] = fp8::amax_pair(dz_amax[q][1], du2);
        const __nv_bfloat162 wa2 = __floats2bfloat162_rn(out_wa[0], out_wa[1]);
        wa_held[i / 2] = *reinterpret_cast<const uint32_t*>(&wa2);
      }
      // Row sums over this thread's columns, then over the quad: fixed order.
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        dw[q] += __shfl_xor_sync(0xFFFFFFFFu, dw[q], 1);
        dw[q] += __shfl_xor_sync(0xFFFFFFFFu, dw[q], 2);
        if ((threadIdx.x & 3) == 0) a.out.dw_partial[(pc.row64 + acc_row(0, 2 * q)) * (I / 128) + pc.cb] = dw[q];
      }
      fence_proxy_async_shared();  // this thread's writes, before the TMA stores read them
      consumer_sync();
      if (storer) {
        for (int c = 0; c < 2; ++c) {
          tma_store_2d(ctx.out_map[0], ctx.boxes + c * kBoxBytes, col0 + c * 64, row);                // dz_g
          tma_store_2d(ctx.out_map[0], ctx.boxes + (2 + c) * kBoxBytes, I + col0 + c * 64, row);      // dz_u
        }
        bulk_commit_group();
      }
      // dz in e4m3 while the TMA stores read the same bf16 (reads only, on both sides).
      if (a.out.dz_q != nullptr) quantize_dz(a, pc, dz_amax, z_g, z_u);
      if (storer) bulk_wait_group_read<0>();
      // quantize_dz's reads of the u part, ordered before the TMA that overwrites it (proxy write-after-read).
      if (h == 0 && a.out.dz_q != nullptr) fence_proxy_async_shared();
      consumer_sync();  // dz has been read out: wa may overwrite the g part
      if (h == 0 && storer) load_z_chunk(p, ctx, z_piece(tile, 1), ZParts::kU);  // the u part is free now
      const HalfTilePlaces place2;  // the same places, offsets rebuilt (see HalfTilePlaces)
#pragma unroll
      for (int i = 0; i < 64; i += 2) *reinterpret_cast<uint32_t*>(at(z_g + place2(i))) = wa_held[i / 2];
      fence_proxy_async_shared();
      consumer_sync();
      if (storer) {
        for (int c = 0; c < 2; ++c) tma_store_2d(ctx.out_map[1], ctx.boxes + c * kBoxBytes, col0 + c * 64, row);
        bulk_commit_group();
        bulk_wait_group_read<0>();
        if (h == 0) load_z_chunk(p, ctx, z_piece(tile, 1), ZParts::kG);  // the g part is free: the rest of chunk 1
      }
    }
    return true;
  }
};

}  // namespace megamoe::cuda::engine
