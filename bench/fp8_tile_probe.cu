// megamoe-fp8-tile-probe: how fast can the FP8 main loop run with a given tile
// shape and ring, before any engine is changed for it (docs/fp8-plan.md,
// "wider FP8 tiles")? A bare M-grouped FP8 GEMM with the recipe's promotion
// (e4m3 A [M, K] and B [E * N, K], both K-major; A scaled per row per 128 K,
// B per 128 x 128 block; fp32 accumulation promoted every 128 K), bf16 out,
// E experts of M / E rows each, in four shapes of CTA:
//   split   S: the engine's today: two consumers, each its own 128 x 128 tile
//              and its own ring of S / 2 stages (32 KB each), main loops at
//              the same time; a k-block in two row halves of m64n128k32.
//   coop128 S: both on one 128 x 128 tile, 64 rows each, one ring of S
//              stages.
//   coop256 S: both on one 128 x 256 tile, 64 rows x two 128-column halves
//              each (the same 64 + 128 registers as split), S stages of 48 KB;
//              `n256`: one m64n256 wgmma a k-step instead of two m64n128
//              (A read from shared memory once, not twice).
//   coop192 S: DeepGEMM's: both on one 128 x 192 tile, 64 rows x 192 columns
//              each, one batch of m64n192k32 and one wait a k-block (96 + 96
//              registers), S stages of 40 KB (shapes with N % 192 == 0).
// `split 4 pair`: split's CTAs in clusters of two sharing each weight tile by
// TMA multicast (24 KB of L2 reads a k-block per CTA instead of 32).
// `bf16 ...`: the promotion-free loops in bf16 on the same values (k-blocks
// of 64: twice the bytes a FLOP), the control for whether L2 bounds them.
// And the loops without the promotion (`nopromo`: each k-block's
// wgmmas accumulate straight into the fp32 accumulator, the scales
// ignored): split's with the recipe loop's group and wait per 64-row half
// (`w0`: what the promotion's scale loads and multiply-adds cost), and each
// shape's with a k-block as one group, the next one issued before it is
// waited for (`w1`, bf16's pipelining: what the waits cost as well). The
// recipe loop's distance to `w1` bounds what any promotion scheme can win
// in that CTA shape. (Session 27 measured more ring depths, session 28 the
// engine's tile order and plan look-ups, session 30 the pipelined promotion
// and pairs sharing the row tile: perf-log; those variants are gone.)
// No epilogue beyond plain bf16 stores of the tile. CUDA-event medians after
// warm-up; each variant's output checked at sampled entries against a
// double-precision dot product of the dequantised operands (without the
// scales for `nopromo`).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_check.h"
#include "cuda/gemm/tensor_map.h"
#include "cuda/ptx/sm90.cuh"

namespace {

using namespace megamoe::cuda::ptx;

#define CHECK_CUDA(x) MEGAMOE_BENCH_CHECK_CUDA("megamoe-fp8-tile-probe", x)

constexpr int kBoxBytes = 64 * 128;     // one TMA box: 64 rows x 128 e4m3
constexpr int kTileBytesA = 2 * kBoxBytes;  // 128 rows

struct Problem {
  int m_per_expert, n, k, experts;
  const float* a_scales;  // [k / 128, M]
  const float* b_scales;  // [E * n / 128, k / 128]
  __nv_bfloat16* d;       // [M, n]
};

// Tile t: expert-major, then n, then m (the m tiles of one n tile adjacent:
// they share its B tile in L2). The engine's order measured 3-12% slower here
// but no slower in the engine (perf-log, session 28).
struct TileCoord {
  int e, m, n;  // m: global 128-row tile; n: BN-column tile
};
template <int kBN>
__device__ __forceinline__ TileCoord tile_of(const Problem& p, int t) {
  const int mt = p.m_per_expert / 128, nt = p.n / kBN;
  const int r = t % (mt * nt);
  TileCoord c;
  c.e = t / (mt * nt), c.m = c.e * mt + r % mt, c.n = r / mt;
  return c;
}

// The wgmma m64nN accumulator layout: register i of this thread holds row
// acc_row(i) of its 64-row half and column acc_col(i).
__device__ __forceinline__ int acc_row(int i) { return 16 * ((threadIdx.x & 127) >> 5) + ((threadIdx.x & 31) >> 2) + 8 * ((i >> 1) & 1); }
__device__ __forceinline__ int acc_col(int i) { return 8 * (i >> 2) + 2 * (threadIdx.x & 3) + (i & 1); }

// Spins until the mbarrier's phase of this parity has completed (the probe
// has no fault to report: a hang is a bug here).
__device__ __forceinline__ void spin_wait(uint64_t* bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// Promo: the recipe's promotion, or none (scales ignored; see the top).
enum class Promo { kRecipe, kNoneWait0, kNoneWait1 };
// Pair: CTAs one at a time, or in clusters of two sharing the weight tile (B)
// or the row tile (A) by multicast (probe_kernel).
enum class Pair { kNone, kShareB };

// wgmma m64n192k32, e4m3 x e4m3 -> f32, both operands K-major in shared
// memory (128-byte swizzle): the coop192 variants' one batch a k-block. Here,
// not in ptx/sm90.cuh, until the engine takes this tile.
__device__ __forceinline__ void wgmma_m64n192k32_e4m3(float (&d)[96], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
      "%96, %97, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// The `n256` rows' one wgmma a k-step over all 256 columns of a consumer's 64
// rows (A read once, not once per 128-column half): e4m3 m64n256k32 here, bf16
// m64n256k16 in ptx/sm90.cuh; both operands K-major in shared memory (128-byte
// swizzle), the accumulator as two 64-register halves (columns 0-127, 128-255).
__device__ __forceinline__ void wgmma_m64n256k32_e4m3(float (&d0)[64], float (&d1)[64], uint64_t desc_a, uint64_t desc_b,
                                       int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1;\n"
      "}\n"
      : "+f"(d0[0]), "+f"(d0[1]), "+f"(d0[2]), "+f"(d0[3]), "+f"(d0[4]), "+f"(d0[5]), "+f"(d0[6]), "+f"(d0[7]), "+f"(d0[8]), "+f"(d0[9]), "+f"(d0[10]), "+f"(d0[11]), "+f"(d0[12]), "+f"(d0[13]), "+f"(d0[14]), "+f"(d0[15]), "+f"(d0[16]), "+f"(d0[17]), "+f"(d0[18]), "+f"(d0[19]), "+f"(d0[20]), "+f"(d0[21]), "+f"(d0[22]), "+f"(d0[23]), "+f"(d0[24]), "+f"(d0[25]), "+f"(d0[26]), "+f"(d0[27]), "+f"(d0[28]), "+f"(d0[29]), "+f"(d0[30]), "+f"(d0[31]), "+f"(d0[32]), "+f"(d0[33]), "+f"(d0[34]), "+f"(d0[35]), "+f"(d0[36]), "+f"(d0[37]), "+f"(d0[38]), "+f"(d0[39]), "+f"(d0[40]), "+f"(d0[41]), "+f"(d0[42]), "+f"(d0[43]), "+f"(d0[44]), "+f"(d0[45]), "+f"(d0[46]), "+f"(d0[47]), "+f"(d0[48]), "+f"(d0[49]), "+f"(d0[50]), "+f"(d0[51]), "+f"(d0[52]), "+f"(d0[53]), "+f"(d0[54]), "+f"(d0[55]), "+f"(d0[56]), "+f"(d0[57]), "+f"(d0[58]), "+f"(d0[59]), "+f"(d0[60]), "+f"(d0[61]), "+f"(d0[62]), "+f"(d0[63]), "+f"(d1[0]), "+f"(d1[1]), "+f"(d1[2]), "+f"(d1[3]), "+f"(d1[4]), "+f"(d1[5]), "+f"(d1[6]), "+f"(d1[7]), "+f"(d1[8]), "+f"(d1[9]), "+f"(d1[10]), "+f"(d1[11]), "+f"(d1[12]), "+f"(d1[13]), "+f"(d1[14]), "+f"(d1[15]), "+f"(d1[16]), "+f"(d1[17]), "+f"(d1[18]), "+f"(d1[19]), "+f"(d1[20]), "+f"(d1[21]), "+f"(d1[22]), "+f"(d1[23]), "+f"(d1[24]), "+f"(d1[25]), "+f"(d1[26]), "+f"(d1[27]), "+f"(d1[28]), "+f"(d1[29]), "+f"(d1[30]), "+f"(d1[31]), "+f"(d1[32]), "+f"(d1[33]), "+f"(d1[34]), "+f"(d1[35]), "+f"(d1[36]), "+f"(d1[37]), "+f"(d1[38]), "+f"(d1[39]), "+f"(d1[40]), "+f"(d1[41]), "+f"(d1[42]), "+f"(d1[43]), "+f"(d1[44]), "+f"(d1[45]), "+f"(d1[46]), "+f"(d1[47]), "+f"(d1[48]), "+f"(d1[49]), "+f"(d1[50]), "+f"(d1[51]), "+f"(d1[52]), "+f"(d1[53]), "+f"(d1[54]), "+f"(d1[55]), "+f"(d1[56]), "+f"(d1[57]), "+f"(d1[58]), "+f"(d1[59]), "+f"(d1[60]), "+f"(d1[61]), "+f"(d1[62]), "+f"(d1[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// One k-block of a 64-row x 128-column block into the temporary d, afresh
// (the first of its four m64n128k32 wgmmas with scale_d 0), as one group.
// a, b: the block's A rows and B columns in the stage (K-major, 128B swizzle).
__device__ __forceinline__ void issue_fresh_kblock(float (&d)[64], const uint8_t* a, const uint8_t* b) {
  fence_accumulators(d);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n128k32_e4m3(d, smem_desc_sw128(a + kk * 32, 0, 1024), smem_desc_sw128(b + kk * 32, 0, 1024),
                          kk > 0 ? 1 : 0);
  wgmma_commit();
}

// coop192 (DeepGEMM's shape): both consumers on one 128 x 192 tile, consumer
// cw its 64 rows x all 192 columns: one batch of four m64n192k32 wgmmas a
// k-block into a 96-register temporary (nopromo: into the accumulator), one
// wait, the stage released before the promotion. Accumulator 96 + temporary
// 96 registers, as split's 64 + 128. (Built with kRecipe and kNoneWait1.)
// A 192-column tile spans two of B's 128-column scale blocks, split at column
// 128 - n0 % 128 (128 or 64): two promotion loops, each with its split fixed.
template <int kStages, Promo kPromo>
__device__ __forceinline__ void consume_n192(const Problem& p, const uint8_t* smem, uint64_t* full, uint64_t* empty,
                                             int tiles, int k_blocks, int cw) {
  constexpr int kBN = 192, kStageBytes = kTileBytesA + kBN * 128;
  const bool leader = (threadIdx.x & 31) == 0;
  float acc[96], tmp[96];
  int it = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const TileCoord c = tile_of<kBN>(p, t);
#pragma unroll
    for (int i = 0; i < 96; ++i) acc[i] = 0.0f;
    const int row0 = c.m * 128 + 64 * cw + acc_row(0);  // this thread's rows: row0, row0 + 8
    const int n0 = c.n * kBN;
    const int64_t blk = (static_cast<int64_t>(c.e) * p.n + n0) / 128;  // B's scale block of column 0
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      float a_s[2] = {}, b_s[2] = {};
      if constexpr (kPromo == Promo::kRecipe) {  // loads fly while the stage is waited for
        const float* a_col = p.a_scales + static_cast<int64_t>(kb) * p.experts * p.m_per_expert;
        a_s[0] = __ldg(a_col + row0), a_s[1] = __ldg(a_col + row0 + 8);
        b_s[0] = __ldg(p.b_scales + blk * k_blocks + kb), b_s[1] = __ldg(p.b_scales + (blk + 1) * k_blocks + kb);
      }
      const int slot = it % kStages;
      spin_wait(&full[slot], (it / kStages) & 1);
      const uint8_t* sa = smem + slot * kStageBytes + cw * kBoxBytes;
      const uint8_t* sb = smem + slot * kStageBytes + kTileBytesA;
      float(&dst)[96] = kPromo == Promo::kRecipe ? tmp : acc;
      fence_accumulators(dst);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_m64n192k32_e4m3(dst, smem_desc_sw128(sa + kk * 32, 0, 1024), smem_desc_sw128(sb + kk * 32, 0, 1024),
                              kPromo == Promo::kRecipe ? (kk > 0 ? 1 : 0) : 1);
      wgmma_commit();
      if constexpr (kPromo == Promo::kNoneWait1) {
        wgmma_wait<1>();  // the previous k-block's group is done: its stage goes back
        if (kb > 0 && leader) mbar_arrive(&empty[(it - 1) % kStages]);
        continue;
      }
      wgmma_wait<0>();
      fence_accumulators(dst);
      if (leader) mbar_arrive(&empty[slot]);  // read out: the producer may refill it during the promotion
      if constexpr (kPromo == Promo::kRecipe) {
        auto promote = [&](auto lo_groups) {  // column groups j = i / 4 below lo_groups: B's block blk
          constexpr int kLo = decltype(lo_groups)::value;
#pragma unroll
          for (int i = 0; i < 96; ++i) acc[i] += tmp[i] * (a_s[(i >> 1) & 1] * b_s[(i >> 2) < kLo ? 0 : 1]);
        };
        if (n0 % 128 == 0) {
          promote(std::integral_constant<int, 16>{});
        } else {
          promote(std::integral_constant<int, 8>{});
        }
      }
    }
    if constexpr (kPromo == Promo::kNoneWait1) {
      wgmma_wait<0>();
      if (k_blocks > 0 && leader) mbar_arrive(&empty[(it - 1) % kStages]);
    }
    fence_accumulators(acc);
#pragma unroll
    for (int i = 0; i < 96; i += 2) {
      const int64_t row = c.m * 128 + 64 * cw + acc_row(i);
      *reinterpret_cast<__nv_bfloat162*>(p.d + row * p.n + n0 + acc_col(i)) = __floats2bfloat162_rn(acc[i], acc[i + 1]);
    }
  }
}

// kSplit: consumer c owns the CTA's tiles j with j % 2 == c (128 x 128, rows in
// two halves) and ring c (kStages / 2 stages); else both share every tile
// and one ring of kStages (64 rows each: kBN 256, two 128-column halves;
// kBN 192, consume_n192).
// kPair (split only): launched as clusters of two CTAs that walk pairs of
// tiles, CTA `rank` taking one of each pair; CTA r loads box r of the shared
// operand of each stage and multicasts it into both CTAs, so each reads 24 KB
// a k-block from L2 instead of 32; a stage's empty barrier then waits for
// both CTAs' consumers (4 local + 4 remote warp arrivals). Pair::kShareB:
// tiles 2u, 2u + 1 (rows m and m + 1 of one expert, one column tile: the
// same weight tile; what SonicMoE's clusters share).
// kBf16: the same loop in bf16 (the control: A and B hold the same values as
// bf16, a k-block is 64 elements, the same 128-byte box rows and stage bytes,
// four m64n128k16 wgmmas a half; no promotion in bf16).
// kN256 (coop256, no promotion): each k-step one m64n256 wgmma over the
// consumer's 64 rows instead of one per 128-column half.
template <int kBN, bool kSplit, int kStages, Promo kPromo = Promo::kRecipe, Pair kPairing = Pair::kNone,
          bool kBf16 = false, bool kN256 = false>
__global__ void __launch_bounds__(384, 1)
    probe_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                 const __grid_constant__ Problem p) {
  constexpr bool kPair = kPairing != Pair::kNone;
  static_assert(!kSplit || kBN == 128, "split: 128 x 128 tiles");
  static_assert(!kPair || kSplit, "pairs: split rings");
  static_assert(!kBf16 || ((kPromo == Promo::kNoneWait0 || kPromo == Promo::kNoneWait1) && kBN != 192),
                "bf16: the loops without promotion, 128 or 256 columns");
  static_assert(!kN256 || (kBN == 256 && !kSplit && kPromo == Promo::kNoneWait1), "n256: coop256 without promotion");
  constexpr int kStageBytes = kTileBytesA + kBN * 128;
  constexpr int kRings = kSplit ? 2 : 1, R = kStages / kRings;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  auto* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int tiles = p.experts * (p.m_per_expert / 128) * (p.n / kBN);
  constexpr int kKBlock = kBf16 ? 64 : 128;  // elements a k-block: one 128-byte box row
  const int k_blocks = p.k / kKBlock;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kSplit && !kPair ? 4 : 8);  // warp leaders of the consumer(s) reading the stage
    }
    fence_barrier_init();
  }
  if constexpr (kPair) {
    cluster_sync();  // the peer multicasts into this CTA and arrives on its barriers: both inits first
  } else {
    __syncthreads();
  }
  // Tile walk: unit u of `units` (a pair-tile for kPair), this CTA's tile of it.
  const uint32_t rank = kPair ? cluster_rank() : 0u;
  const int unit0 = kPair ? blockIdx.x / 2 : blockIdx.x, units = kPair ? gridDim.x / 2 : gridDim.x;
  const int unit_count = kPair ? tiles / 2 : tiles;
  auto tile_index = [&](int u) {
    if constexpr (kPairing == Pair::kShareB) return 2 * u + static_cast<int>(rank);
    return u;
  };
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<40>();
    // Producer: warp r's first lane fills ring r (split), warp 0's the one ring.
    const int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) != 0 || warp >= kRings) return;
    const int first = unit0 + (kSplit ? warp : 0) * units, stride = kRings * units;
    int it = 0;
    for (int u = first; u < unit_count; u += stride) {
      const TileCoord c = tile_of<kBN>(p, tile_index(u));
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % R, slot = warp * R + s;
        if (it >= R)
          spin_wait(&empty[slot], ((it / R) - 1) & 1);
        mbar_arrive_expect_tx(&full[slot], kStageBytes);
        uint8_t* stage = smem + slot * kStageBytes;
        for (int b = 0; b < 2; ++b)  // A: this CTA's own row tile
          tma_load_2d(stage + b * kBoxBytes, &map_a, &full[slot], kb * kKBlock, c.m * 128 + 64 * b);
        for (int b = 0; b < kBN / 64; ++b) {  // B: its own, or (a pair) box `rank` of the shared tile into both CTAs
          uint8_t* dst = stage + kTileBytesA + b * kBoxBytes;
          const int row = c.e * p.n + c.n * kBN + 64 * b;
          if constexpr (!kPair) {
            tma_load_2d(dst, &map_b, &full[slot], kb * kKBlock, row);
          } else if (b == static_cast<int>(rank)) {
            tma_load_2d_multicast(dst, &map_b, &full[slot], kb * kKBlock, row, 0b11);
          }
        }
      }
    }
    // A pair: stay until both CTAs' consumers have released every stage of
    // this ring (the peer's last arrivals land in this CTA's shared memory).
    if constexpr (kPair)
      for (int s = 0; s < R; ++s, ++it)
        spin_wait(&empty[warp * R + it % R], ((it / R) - 1) & 1);
    return;
  }
  setmaxnreg_inc<232>();
  const int cw = wg - 1;
  if constexpr (kBN == 192) {
    consume_n192<kStages, kPromo>(p, smem, full, empty, tiles, k_blocks, cw);
  } else {
    const bool leader = (threadIdx.x & 31) == 0;
    const int ring0 = kSplit ? cw * R : 0;
    const int first = unit0 + (kSplit ? cw : 0) * units, stride = kRings * units;
    // A stage goes back to this CTA's producer and, for a pair, the peer's (it multicast into it).
    auto release = [&](int slot) {
      mbar_arrive(&empty[slot]);
      if constexpr (kPair) mbar_arrive_cluster(&empty[slot], rank ^ 1u);
    };
    // acc[x]: split, rows [64x, 64x + 64) of the tile; coop, columns [128x, 128x + 128) of this consumer's 64 rows.
    constexpr int kHalves = kSplit ? 2 : kBN / 128;
    float acc[2][64];
    float tmp[64];
    int it = 0;
    for (int u = first; u < unit_count; u += stride) {
      const TileCoord c = tile_of<kBN>(p, tile_index(u));
#pragma unroll
      for (int x = 0; x < 2; ++x)
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[x][i] = 0.0f;
      // This thread's rows (r and r + 8 of each 64-row half it computes).
      const int row0 = c.m * 128 + (kSplit ? 0 : 64 * cw) + acc_row(0);
      if constexpr (kPromo != Promo::kRecipe) {
        // No promotion: every k-block's wgmmas add into acc (scale_d 1 on a zeroed acc).
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int slot = ring0 + it % R;
          spin_wait(&full[slot], (it / R) & 1);
          const uint8_t* sa = smem + slot * kStageBytes;
          const uint8_t* sb = sa + kTileBytesA;
          fence_accumulators(acc[0]);
          fence_accumulators(acc[1]);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kN256 && kk < 4; ++kk) {  // B's 256 rows lie contiguous in the stage: one descriptor
            const uint64_t da = smem_desc_sw128(sa + cw * kBoxBytes + kk * 32, 0, 1024);
            const uint64_t db = smem_desc_sw128(sb + kk * 32, 0, 1024);
            if constexpr (kBf16) {
              wgmma_m64n256k16_bf16(acc[0], acc[1], da, db, 1);
            } else {
              wgmma_m64n256k32_e4m3(acc[0], acc[1], da, db, 1);
            }
          }
#pragma unroll
          for (int x = 0; !kN256 && x < kHalves; ++x) {
            const uint8_t* a = sa + (kSplit ? x : cw) * kBoxBytes;
            const uint8_t* b = sb + (kSplit ? 0 : x) * 128 * 128;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
              if constexpr (kBf16) {
                wgmma_m64n128k16_bf16<0, 0>(acc[x], smem_desc_sw128(a + kk * 32, 0, 1024),
                                            smem_desc_sw128(b + kk * 32, 0, 1024), 1);
              } else {
                wgmma_m64n128k32_e4m3(acc[x], smem_desc_sw128(a + kk * 32, 0, 1024),
                                      smem_desc_sw128(b + kk * 32, 0, 1024), 1);
              }
            if constexpr (kPromo == Promo::kNoneWait0) {  // the recipe's group and wait per half, no arithmetic
              wgmma_commit();
              wgmma_wait<0>();
            }
          }
          if constexpr (kPromo == Promo::kNoneWait1) {
            // This k-block's group stays in flight; the previous one is done, so its stage goes back.
            wgmma_commit();
            wgmma_wait<1>();
            if (kb > 0 && leader) release(ring0 + (it - 1) % R);
          } else {
            if (leader) release(slot);
          }
        }
        if constexpr (kPromo == Promo::kNoneWait1) {
          wgmma_wait<0>();
          if (k_blocks > 0 && leader) release(ring0 + (it - 1) % R);
        }
        fence_accumulators(acc[0]);
        fence_accumulators(acc[1]);
      }
      for (int kb = 0; kPromo == Promo::kRecipe && kb < k_blocks; ++kb, ++it) {
        // Scales first: their loads fly while the stage is waited for. a_s[x]:
        // rows r, r + 8 of row half x (coop: the one half); b_s[x]: column half x's block.
        float a_s[2][2] = {}, b_s[2] = {};
        const float* a_col = p.a_scales + static_cast<int64_t>(kb) * p.experts * p.m_per_expert;
#pragma unroll
        for (int x = 0; x < (kSplit ? 2 : 1); ++x) {
          a_s[x][0] = __ldg(a_col + row0 + 64 * x);
          a_s[x][1] = __ldg(a_col + row0 + 64 * x + 8);
        }
#pragma unroll
        for (int x = 0; x < (kSplit ? 1 : kHalves); ++x)
          b_s[x] = __ldg(p.b_scales + static_cast<int64_t>((c.e * p.n + c.n * kBN) / 128 + x) * k_blocks + kb);
        const int s = it % R, slot = ring0 + s;
        spin_wait(&full[slot], (it / R) & 1);
        const uint8_t* sa = smem + slot * kStageBytes;
        const uint8_t* sb = sa + kTileBytesA;
#pragma unroll
        for (int x = 0; x < kHalves; ++x) {
          const uint8_t* a = sa + (kSplit ? x : cw) * kBoxBytes;
          const uint8_t* b = sb + (kSplit ? 0 : x) * 128 * 128;
          issue_fresh_kblock(tmp, a, b);
          wgmma_wait<0>();
          fence_accumulators(tmp);
          const float sx = kSplit ? b_s[0] : b_s[x];
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[x][i] += tmp[i] * ((kSplit ? a_s[x][(i >> 1) & 1] : a_s[0][(i >> 1) & 1]) * sx);
        }
        if (leader) release(slot);
      }
#pragma unroll
      for (int x = 0; x < kHalves; ++x)
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
          const int64_t row = c.m * 128 + (kSplit ? 64 * x : 64 * cw) + acc_row(i);
          const int col = c.n * kBN + (kSplit ? 0 : 128 * x) + acc_col(i);
          *reinterpret_cast<__nv_bfloat162*>(p.d + row * p.n + col) = __floats2bfloat162_rn(acc[x][i], acc[x][i + 1]);
        }
    }
  }
}

struct Variant {
  const char* name;
  int bn, stages;
  bool scaled;  // false: no promotion, scales ignored (checked against the unscaled product)
  void (*kernel)(CUtensorMap, CUtensorMap, Problem);
  bool pair = false;  // launched as 2-CTA clusters
  bool bf16 = false;  // bf16 operands (the same values), k-blocks of 64
};

const Variant kVariants[] = {
    {"split 4", 128, 4, true, probe_kernel<128, true, 4>},
    {"split 4 nopromo w0", 128, 4, false, probe_kernel<128, true, 4, Promo::kNoneWait0>},
    {"split 4 nopromo w1", 128, 4, false, probe_kernel<128, true, 4, Promo::kNoneWait1>},
    {"split 4 pair", 128, 4, true, probe_kernel<128, true, 4, Promo::kRecipe, Pair::kShareB>, true},
    {"split 4 pair nopromo w0", 128, 4, false, probe_kernel<128, true, 4, Promo::kNoneWait0, Pair::kShareB>, true},
    {"split 6", 128, 6, true, probe_kernel<128, true, 6>},  // rings of 3: room for the pair's skew
    {"split 6 pair", 128, 6, true, probe_kernel<128, true, 6, Promo::kRecipe, Pair::kShareB>, true},
    // The bf16 control: is the loop bound by L2 (bf16 moves twice the bytes a FLOP)?
    {"bf16 split 6 w1", 128, 6, false, probe_kernel<128, true, 6, Promo::kNoneWait1, Pair::kNone, true>, false, true},
    {"bf16 split 6 pair w1", 128, 6, false, probe_kernel<128, true, 6, Promo::kNoneWait1, Pair::kShareB, true>, true,
     true},
    {"bf16 coop256 4 w1", 256, 4, false, probe_kernel<256, false, 4, Promo::kNoneWait1, Pair::kNone, true>, false,
     true},
    {"bf16 coop256 4 n256 w1", 256, 4, false,
     probe_kernel<256, false, 4, Promo::kNoneWait1, Pair::kNone, true, true>, false, true},
    // Three 48 KB stages leave room for the engine's staging tiles (session 18's wide tiles had three).
    {"bf16 coop256 3 w1", 256, 3, false, probe_kernel<256, false, 3, Promo::kNoneWait1, Pair::kNone, true>, false,
     true},
    {"bf16 coop256 3 n256 w1", 256, 3, false,
     probe_kernel<256, false, 3, Promo::kNoneWait1, Pair::kNone, true, true>, false, true},
    {"coop256 4", 256, 4, true, probe_kernel<256, false, 4>},
    {"coop256 4 nopromo w1", 256, 4, false, probe_kernel<256, false, 4, Promo::kNoneWait1>},
    {"coop256 4 nopromo n256 w1", 256, 4, false,
     probe_kernel<256, false, 4, Promo::kNoneWait1, Pair::kNone, false, true>},
    {"coop128 6", 128, 6, true, probe_kernel<128, false, 6>},
    {"coop128 6 nopromo w1", 128, 6, false, probe_kernel<128, false, 6, Promo::kNoneWait1>},
    {"coop192 5", 192, 5, true, probe_kernel<192, false, 5>},
    {"coop192 5 nopromo w1", 192, 5, false, probe_kernel<192, false, 5, Promo::kNoneWait1>},
};

float e4m3_value(uint8_t v) {
  __nv_fp8_e4m3 f;
  f.__x = v;
  return static_cast<float>(f);
}

int run_shape(const char* label, int experts, int m_per_expert, int n, int k, int reps) {
  if (k < 128 || k % 128 != 0 || m_per_expert % 128 != 0 || n % 128 != 0) {  // whole tiles and k-blocks, one at least
    std::fprintf(stderr, "megamoe-fp8-tile-probe: %s: K must be a positive multiple of 128, rows and N of 128\n", label);
    return 1;
  }
  const int64_t M = static_cast<int64_t>(experts) * m_per_expert;
  std::mt19937 rng(1234);
  std::vector<uint8_t> ha(M * k), hb(static_cast<int64_t>(experts) * n * k);
  // e4m3 codes with |v| < 2 (exponent field 0..7), random sign: four a draw.
  auto fill = [&](std::vector<uint8_t>& v) {
    for (size_t i = 0; i < v.size(); i += 4) {
      const uint32_t r = static_cast<uint32_t>(rng()) & 0xBFBFBFBFu;
      std::memcpy(v.data() + i, &r, std::min<size_t>(4, v.size() - i));
    }
  };
  fill(ha);
  fill(hb);
  std::uniform_real_distribution<float> sd(0.5f, 2.0f);
  std::vector<float> hsa(static_cast<int64_t>(k / 128) * M), hsb(static_cast<int64_t>(experts) * n / 128 * (k / 128));
  for (auto& s : hsa) s = sd(rng);
  for (auto& s : hsb) s = sd(rng);
  uint8_t *da, *db;
  float *dsa, *dsb;
  __nv_bfloat16* dd;
  CHECK_CUDA(cudaMalloc(&da, ha.size()));
  CHECK_CUDA(cudaMalloc(&db, hb.size()));
  CHECK_CUDA(cudaMalloc(&dsa, hsa.size() * 4));
  CHECK_CUDA(cudaMalloc(&dsb, hsb.size() * 4));
  CHECK_CUDA(cudaMalloc(&dd, M * n * 2));
  CHECK_CUDA(cudaMemcpy(da, ha.data(), ha.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(db, hb.data(), hb.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dsa, hsa.data(), hsa.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dsb, hsb.data(), hsb.size() * 4, cudaMemcpyHostToDevice));
  // The bf16 control's operands: the same values (every e4m3 value is a bf16 one).
  auto widen = [](const std::vector<uint8_t>& v) {
    std::vector<__nv_bfloat16> w(v.size());
    for (size_t i = 0; i < v.size(); ++i) w[i] = __float2bfloat16(e4m3_value(v[i]));
    return w;
  };
  const std::vector<__nv_bfloat16> ha16 = widen(ha), hb16 = widen(hb);
  __nv_bfloat16 *da16, *db16;
  CHECK_CUDA(cudaMalloc(&da16, ha16.size() * 2));
  CHECK_CUDA(cudaMalloc(&db16, hb16.size() * 2));
  CHECK_CUDA(cudaMemcpy(da16, ha16.data(), ha16.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(db16, hb16.data(), hb16.size() * 2, cudaMemcpyHostToDevice));
  CUtensorMap ma, mb, ma16, mb16;
  const int64_t b_rows = static_cast<int64_t>(experts) * n;
  if (!megamoe::cuda::make_tma_2d_e4m3_box64x128(da, M, k, &ma).ok() ||
      !megamoe::cuda::make_tma_2d_e4m3_box64x128(db, b_rows, k, &mb).ok() ||
      !megamoe::cuda::make_tma_2d_bf16_box64(da16, M, k, &ma16).ok() ||
      !megamoe::cuda::make_tma_2d_bf16_box64(db16, b_rows, k, &mb16).ok()) {
    std::fprintf(stderr, "megamoe-fp8-tile-probe: tensor maps failed\n");
    return 2;
  }
  const Problem p{m_per_expert, n, k, experts, dsa, dsb, dd};
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  const double flops = 2.0 * static_cast<double>(M) * n * k;
  int failures = 0;
  std::printf("%s: E %d x %d rows, N %d, K %d (%.2f TFLOP)\n", label, experts, m_per_expert, n, k, flops * 1e-12);
  std::printf("  %-23s %9s %9s %8s\n", "variant", "us", "TFLOP/s", "max err");
  for (const Variant& v : kVariants) {
    if (n % v.bn != 0) {  // no partial column tiles in the probe
      std::printf("  %-23s %9s %9s %8s  (N %% %d != 0)\n", v.name, "-", "-", "-", v.bn);
      continue;
    }
    const int smem = v.stages * (kTileBytesA + v.bn * 128) + 2 * v.stages * 8 + 1024;
    CHECK_CUDA(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CHECK_CUDA(cudaMemset(dd, 0, M * n * 2));
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(sms);
    cfg.blockDim = dim3(384);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute cluster{};
    if (v.pair) {
      if (p.m_per_expert % 256 != 0 || (n / v.bn) % 2 != 0) {  // pairs of row tiles, or of column tiles
        std::printf("  %-23s %9s %9s %8s  (odd row or column tiles)\n", v.name, "-", "-", "-");
        continue;
      }
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = 2, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
      cfg.attrs = &cluster;
      cfg.numAttrs = 1;
      cfg.gridDim = dim3(sms / 2 * 2);
      int pairs = 0;  // as many pairs as fit side by side (a GPC with an odd SM count leaves one out)
      CHECK_CUDA(cudaOccupancyMaxActiveClusters(&pairs, v.kernel, &cfg));
      if (pairs <= 0) {
        std::fprintf(stderr, "megamoe-fp8-tile-probe: %s: no pair of CTAs fits\n", v.name);
        return failures + 1;
      }
      cfg.gridDim = dim3(2 * std::min(pairs, sms / 2));
    }
    std::vector<float> ms;
    for (int r = 0; r < reps + 3; ++r) {
      CHECK_CUDA(cudaEventRecord(e0));
      CHECK_CUDA(cudaLaunchKernelEx(&cfg, v.kernel, v.bf16 ? ma16 : ma, v.bf16 ? mb16 : mb, p));
      CHECK_CUDA(cudaEventRecord(e1));
      CHECK_CUDA(cudaEventSynchronize(e1));
      CHECK_CUDA(cudaGetLastError());
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
      if (r >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    // Sampled entries against the dequantised double-precision product.
    std::vector<__nv_bfloat16> hd(M * n);
    CHECK_CUDA(cudaMemcpy(hd.data(), dd, hd.size() * 2, cudaMemcpyDeviceToHost));
    double worst = 0;
    std::mt19937 pick(99);
    for (int s = 0; s < 256; ++s) {
      const int64_t row = pick() % M;
      const int col = static_cast<int>(pick() % n);
      const int e = static_cast<int>(row / m_per_expert);
      double ref = 0, mag = 0;
      for (int kb = 0; kb < k / 128; ++kb) {
        double part = 0;
        for (int kk = 0; kk < 128; ++kk) {
          const int64_t kc = static_cast<int64_t>(kb) * 128 + kk;
          part += static_cast<double>(e4m3_value(ha[row * k + kc])) * e4m3_value(hb[(static_cast<int64_t>(e) * n + col) * k + kc]);
        }
        const double sc = !v.scaled ? 1.0
                                    : static_cast<double>(hsa[static_cast<int64_t>(kb) * M + row]) *
                                          hsb[(static_cast<int64_t>(e) * n + col) / 128 * (k / 128) + kb];
        ref += part * sc;
        mag += std::fabs(part * sc);
      }
      const double got = static_cast<double>(__bfloat162float(hd[row * n + col]));
      worst = std::max(worst, std::fabs(got - ref) / (mag + 1e-30));
    }
    const bool ok = worst < 1e-2;  // bf16 output rounding (2^-9) over the magnitude, with margin
    failures += ok ? 0 : 1;
    std::printf("  %-23s %9.1f %9.1f %8.1e  %4u CTAs%s\n", v.name, med * 1e3, flops / (med * 1e-3) * 1e-12, worst,
                cfg.gridDim.x, ok ? "" : "  WRONG");
  }
  CHECK_CUDA(cudaFree(da));
  CHECK_CUDA(cudaFree(db));
  CHECK_CUDA(cudaFree(da16));
  CHECK_CUDA(cudaFree(db16));
  CHECK_CUDA(cudaFree(dsa));
  CHECK_CUDA(cudaFree(dsb));
  CHECK_CUDA(cudaFree(dd));
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 10;
  int failures = 0;
  // kGateUp's products at 16384 tokens, k 8, E 128 (1024 rows per expert):
  // Qwen3-235B-A22B (N 2I = 3072, K = H 4096) and Qwen3-30B-A3B (1536, 2048);
  // kDown's at 235B (N = H 4096, K = I 1536).
  failures += run_shape("kGateUp 235B", 128, 1024, 3072, 4096, reps);
  failures += run_shape("kGateUp 30B", 128, 1024, 1536, 2048, reps);
  failures += run_shape("kDown 235B", 128, 1024, 4096, 1536, reps);
  return failures == 0 ? 0 : 1;
}
