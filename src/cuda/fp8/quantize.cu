#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <string>

#include "cuda/common/cuda_status.h"
#include "cuda/fp8/e4m3.cuh"
#include "cuda/fp8/quantize.h"

namespace megamoe::cuda {
namespace {

constexpr int kTile = 128;

using fp8::E4m3Quotients;
using fp8::fold_amax;
using fp8::tile_scale;

// The amax of 8 bf16 values (one 16-byte load), kept as a bf16 pair: |v|
// and the maximum taken on pairs (exact: the values are bf16; NaN
// propagates). amax_of_8 folds it to the float fold_amax would make (a NaN
// the canonical one).
__device__ __forceinline__ __nv_bfloat162 amax_pair_of_8(const uint4& raw) {
  const auto* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
  return __hmax2_nan(__hmax2_nan(__habs2(p[0]), __habs2(p[1])), __hmax2_nan(__habs2(p[2]), __habs2(p[3])));
}
__device__ __forceinline__ float amax_of_8(const uint4& raw) { return fp8::amax_of_pair(amax_pair_of_8(raw)); }

// A 1 x 128 tile's amax over the 16 lanes of a half-warp (xor offsets below
// 16; every lane takes part), each holding 8 of its values: reduced as bf16
// pairs (one max a step instead of fold_amax's NaN tests), folded once.
__device__ __forceinline__ float half_warp_amax(const uint4& raw) {
  __nv_bfloat162 m = amax_pair_of_8(raw);
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) m = __hmax2_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  return fp8::amax_of_pair(m);
}

// The 8 bf16 values of one 16-byte load as floats.
__device__ __forceinline__ void unpack8(const uint4& raw, float (&v)[8]) {
  const auto* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(p[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}

// A half-warp's 1 x 128 tile, 8 bf16 values a lane: its scale (*s) and this
// lane's 8 e4m3 codes.
__device__ __forceinline__ uint2 quantize_half_warp_tile(const uint4& raw, Fp8Scale kind, float* s) {
  float v[8];
  unpack8(raw, v);
  const float amax = half_warp_amax(raw);
  *s = tile_scale(amax, kind);
  return E4m3Quotients(*s, amax, kind).pack8(v);
}

// The tiles of [rows, cols] are consecutive 128-element runs (tile t at
// element 128 t, its scale at t). Each half-warp takes one tile per step, each
// lane 8 values (one 16-byte load); a warp keeps kTilesInFlight tiles' loads
// outstanding before it reduces any of them, and strides over the grid
// (row_blocks): the one-tile-per-warp form ran at 1.4 TB/s.
constexpr int kHalfSteps = 4;                       // tiles per half-warp per step
constexpr int kTilesInFlight = 2 * kHalfSteps;      // per warp
constexpr int kRowThreads = 256;

// Where a tile's values come from: consecutive rows of x (Rows), or pool
// rows gathered from token rows as gather_rows does it (Gather: pool row r is
// x row row_src[r] / k, zeros where row_src[r] < 0; the pool's used rows are
// *pool_rows, read on the device; `copy`, if set, receives the bf16 pool too).
// Both also say where tile t's scale goes (RowScales: [rows, cols / 128] at
// t, or [cols / 128, rows] at (t % segs) rows + t / segs).
struct ScaleIndex {
  uint32_t segs;   // tiles per row: cols / 128
  int64_t rows;    // the scales' row count (by k-block: their row stride)
  bool by_k_block;
  __device__ int64_t operator()(int64_t t) const {
    if (!by_k_block) return t;
    const uint32_t t32 = static_cast<uint32_t>(t), r = t32 / segs;  // tile indices fit 32 bits (checked at launch)
    return static_cast<int64_t>(t32 - r * segs) * rows + r;
  }
};
struct RowsSource {
  const __nv_bfloat16* x;
  int64_t tiles;
  ScaleIndex scale_at;
  const int32_t* used_rows;  // optional: only the first *used_rows rows (read on the device)
  __device__ int64_t count() const {
    if (used_rows == nullptr) return tiles;
    const int64_t used = static_cast<int64_t>(*used_rows) * scale_at.segs;
    return used < tiles ? used : tiles;
  }
  __device__ const __nv_bfloat16* tile(int64_t t) const { return x + t * kTile; }
  __device__ void copy(int64_t, int, uint4) const {}
  __device__ uint8_t* q_tile(uint8_t* q, int64_t t) const { return q + t * kTile; }
  __device__ float* scale_of(float* scales, int64_t t) const { return scales + scale_at(t); }
};
// Consecutive rows of x into a dispatch's e4m3 slots (quantize_e4m3_rows_to_slots):
// row r's q at slots + r * slot_bytes, its scales right after its cols bytes.
struct RowsToSlotsSource {
  const __nv_bfloat16* x;
  int64_t tiles;
  uint32_t segs;  // tiles per row: cols / 128; tile indices fit 32 bits (checked at launch)
  int64_t slot_bytes;
  __device__ int64_t count() const { return tiles; }
  __device__ const __nv_bfloat16* tile(int64_t t) const { return x + t * kTile; }
  __device__ void copy(int64_t, int, uint4) const {}
  __device__ uint8_t* q_tile(uint8_t* slots, int64_t t) const {
    const uint32_t t32 = static_cast<uint32_t>(t), r = t32 / segs;
    return slots + r * slot_bytes + (t32 - r * segs) * kTile;
  }
  __device__ float* scale_of(float* slots, int64_t t) const {
    const uint32_t t32 = static_cast<uint32_t>(t), r = t32 / segs;
    return reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(slots) + r * slot_bytes + segs * kTile) +
           (t32 - r * segs);
  }
};
struct GatherSource {
  const __nv_bfloat16* x;
  const int32_t* row_src;
  const int32_t* pool_rows;
  int k;
  uint32_t segs;  // tiles per row: cols / 128; tile indices fit 31 bits (checked at launch)
  uint4* pool;    // optional bf16 copy [capacity, cols]
  ScaleIndex scale_at;
  __device__ int64_t count() const { return static_cast<int64_t>(*pool_rows) * segs; }
  __device__ const __nv_bfloat16* tile(int64_t t) const {
    const uint32_t t32 = static_cast<uint32_t>(t), r = t32 / segs;  // (a 64-bit division is a long software sequence)
    const int32_t s = row_src[r];
    return s < 0 ? nullptr : x + (static_cast<int64_t>(s / k) * segs + (t32 - r * segs)) * kTile;
  }
  __device__ void copy(int64_t t, int hl, uint4 v) const {
    if (pool != nullptr) pool[t * (kTile / 8) + hl] = v;
  }
  __device__ uint8_t* q_tile(uint8_t* q, int64_t t) const { return q + t * kTile; }
  __device__ float* scale_of(float* scales, int64_t t) const { return scales + scale_at(t); }
};

// At most 64 registers (4 blocks, 32 warps an SM): the loads in flight per
// SM are what the pass's bandwidth needs, and 65-72 registers leave 3 blocks.
template <typename Source>
__global__ void __launch_bounds__(kRowThreads, 4) quantize_rows_kernel(const Source src, Fp8Scale kind, uint8_t* q,
                                                                       float* scales) {
  const int lane = threadIdx.x & 31, half = lane >> 4, hl = lane & 15;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int64_t tiles = src.count();
  for (int64_t base = warp * kTilesInFlight; base < tiles; base += warps * kTilesInFlight) {
    uint4 raw[kHalfSteps];
#pragma unroll
    for (int u = 0; u < kHalfSteps; ++u) {
      const int64_t t = base + 2 * u + half;
      const __nv_bfloat16* from = t < tiles ? src.tile(t) : nullptr;
      raw[u] = from != nullptr ? __ldg(reinterpret_cast<const uint4*>(from) + hl) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kHalfSteps; ++u) {
      const int64_t t = base + 2 * u + half;
      float s;
      const uint2 packed = quantize_half_warp_tile(raw[u], kind, &s);
      if (t < tiles) {
        reinterpret_cast<uint2*>(src.q_tile(q, t))[hl] = packed;
        if (hl == 0) *src.scale_of(scales, t) = s;
        src.copy(t, hl, raw[u]);
      }
    }
  }
}

// The scatter form of GatherSource (scatter_quantize_e4m3_rows): token tile t
// (token v = t / segs, segment t % segs) is read and quantised once and
// written to the pool row route_row[v k + j] of each of its k routes that has
// one below *pool_rows: the gather reads each token row k times, this once.
// The same half-warp tiles and arithmetic as quantize_rows_kernel.
struct ScatterDests {
  const int32_t* route_row;  // [tokens * k] pool row of each route, -1: none
  const int32_t* pool_rows;  // [1] the pool's used rows
  int k;
  uint32_t segs;             // tiles per row: cols / 128; tile indices fit 31 bits (checked at launch)
  ScaleIndex scale_at;
  uint4* pool;               // optional bf16 copy [capacity, cols]
};
__global__ void __launch_bounds__(kRowThreads, 4) scatter_quantize_rows_kernel(const __nv_bfloat16* x, int64_t tiles,
                                                                               const ScatterDests d, Fp8Scale kind,
                                                                               uint8_t* q, float* scales) {
  const int lane = threadIdx.x & 31, half = lane >> 4, hl = lane & 15;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int32_t used = *d.pool_rows;
  for (int64_t base = warp * kTilesInFlight; base < tiles; base += warps * kTilesInFlight) {
    uint4 raw[kHalfSteps];
#pragma unroll
    for (int u = 0; u < kHalfSteps; ++u) {
      const int64_t t = base + 2 * u + half;
      raw[u] = t < tiles ? __ldg(reinterpret_cast<const uint4*>(x + t * kTile) + hl) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kHalfSteps; ++u) {
      const int64_t t = base + 2 * u + half;
      float s;
      const uint2 packed = quantize_half_warp_tile(raw[u], kind, &s);
      if (t >= tiles) continue;
      const uint32_t t32 = static_cast<uint32_t>(t), token = t32 / d.segs, seg = t32 - token * d.segs;
      const int32_t* routes = d.route_row + static_cast<int64_t>(token) * d.k;
#pragma unroll 4
      for (int j = 0; j < d.k; ++j) {
        const int32_t r = __ldg(routes + j);
        if (r < 0 || r >= used) continue;
        const int64_t pt = static_cast<int64_t>(r) * d.segs + seg;
        reinterpret_cast<uint2*>(q + pt * kTile)[hl] = packed;
        if (hl == 0) scales[d.scale_at(pt)] = s;
        if (d.pool != nullptr) d.pool[pt * (kTile / 8) + hl] = raw[u];
      }
    }
  }
}

// The pool's padding rows (row_src < 0, below *pool_rows) as the gather makes
// them: the e4m3 codes and scale of an all-zero tile, zero bf16 copies. A warp a row.
__global__ void __launch_bounds__(kRowThreads) zero_padding_rows_kernel(const int32_t* row_src,
                                                                        const int32_t* pool_rows, uint32_t segs,
                                                                        ScaleIndex scale_at, Fp8Scale kind, uint8_t* q,
                                                                        float* scales, uint4* pool) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int32_t used = *pool_rows;
  const float zeros[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const float s = tile_scale(0.0f, kind);
  const uint2 packed = E4m3Quotients(s, 0.0f, kind).pack8(zeros);
  for (int64_t r = warp; r < used; r += warps) {
    if (__ldg(row_src + r) >= 0) continue;
    const int64_t row_tiles = static_cast<int64_t>(segs);
    auto* q_row = reinterpret_cast<uint2*>(q + r * row_tiles * kTile);
    for (int64_t i = lane; i < row_tiles * (kTile / 8); i += 32) q_row[i] = packed;
    for (int64_t i = lane; i < row_tiles; i += 32) scales[scale_at(r * row_tiles + i)] = s;
    if (pool != nullptr)
      for (int64_t i = lane; i < row_tiles * (kTile / 8); i += 32) pool[r * row_tiles * (kTile / 8) + i] = make_uint4(0, 0, 0, 0);
  }
}

// One 256-thread block per 128 x 128 tile; each thread 64 values: 8
// consecutive rows r0 .. r0 + 7 (r0 = 8 (t / 16)) x 8 columns c8 .. c8 + 7
// (c8 = 8 (t % 16)), so 16 threads cover each row (16-byte loads, 8-byte q
// stores). The transposed copy goes through shared memory: a thread's 8
// values of one column are 8 consecutive rows of the transposed tile, one
// 8-byte store (the byte-wide form, 64 one-byte stores per thread with bank
// conflicts, ran at ~2.5 TB/s), read back 8 bytes at a time.
constexpr int kTransposePitch = kTile + 8;  // bytes per row of the transposed tile (8-byte aligned)

// A thread's 8 rows r0 .. r0 + 7 at columns c8 .. c8 + 7 of a 128 x 128 tile (row stride `cols`).
__device__ __forceinline__ void load_rows_8x8(const __nv_bfloat16* src, int64_t cols, int r0, int c8, uint4 (&raw)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) raw[i] = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r0 + i) * cols + c8);
}

// Where the column quantizer's 128 x 128 tile (tr, tc) comes from: the rows
// of x (TileRows), or pool rows gathered from x as gather_rows makes them
// (TileGather: pool row r is x row row_src[r] / k, zeros where row_src[r] <
// 0; the row blocks from *pool_rows on are skipped, not written).
struct TileRows {
  const __nv_bfloat16* x;
  const int32_t* used_rows;  // optional: the row blocks from *used_rows on are skipped
  __device__ bool skip(int64_t tr) const { return used_rows != nullptr && tr * kTile >= *used_rows; }
  __device__ void load(int64_t tr, int64_t tc, int64_t cols, int r0, int c8, uint4 (&raw)[8]) const {
    load_rows_8x8(x + tr * kTile * cols + tc * kTile, cols, r0, c8, raw);
  }
};
struct TileGather {
  const __nv_bfloat16* x;
  const int32_t* row_src;
  const int32_t* pool_rows;
  int k;
  __device__ bool skip(int64_t tr) const { return tr * kTile >= *pool_rows; }
  __device__ void load(int64_t tr, int64_t tc, int64_t cols, int r0, int c8, uint4 (&raw)[8]) const {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int32_t s = row_src[tr * kTile + r0 + i];
      raw[i] = s < 0 ? make_uint4(0, 0, 0, 0)
                     : __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(s / k) * cols + tc * kTile + c8));
    }
  }
};

// Once every thread has stored its bytes into the transposed tile: its rows
// (the tile's columns) to dst, row c at dst + c * pitch, 16 threads per row.
__device__ __forceinline__ void store_transposed_tile(const uint8_t (&tile_t)[kTile][kTransposePitch], uint8_t* dst,
                                                      int64_t pitch) {
  __syncthreads();
  const int t = threadIdx.x, c8 = (t % 16) * 8;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int c = t / 16 + 16 * i;
    *reinterpret_cast<uint2*>(dst + static_cast<int64_t>(c) * pitch + c8) =
        *reinterpret_cast<const uint2*>(&tile_t[c][c8]);
  }
}

__global__ void __launch_bounds__(256, 4) quantize_blocks_kernel(const __nv_bfloat16* w, int64_t rows, int64_t cols, Fp8Scale kind, uint8_t* q,
                                       uint8_t* q_t, float* scales) {
  __shared__ float warp_amax[8];
  __shared__ __align__(8) uint8_t tile_t[kTile][kTransposePitch];  // [column][row]
  const int64_t tiles_r = rows / kTile, tiles_c = cols / kTile;
  const int64_t b = blockIdx.x / (tiles_r * tiles_c), rc = blockIdx.x % (tiles_r * tiles_c);
  const int64_t tr = rc / tiles_c, tc = rc % tiles_c;
  const __nv_bfloat16* src = w + b * rows * cols + tr * kTile * cols + tc * kTile;
  const int t = threadIdx.x, c8 = (t % 16) * 8, r0 = (t / 16) * 8;
  uint4 raw[8];  // the values stay bf16 in registers (32, not 64: occupancy) until quantised
  load_rows_8x8(src, cols, r0, c8, raw);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fold_amax(amax, amax_of_8(raw[i]));
  for (int o = 16; o > 0; o >>= 1) amax = fold_amax(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  if ((t & 31) == 0) warp_amax[t / 32] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int i = 0; i < 8; ++i) amax = fold_amax(amax, warp_amax[i]);
  const float s = tile_scale(amax, kind);
  const E4m3Quotients by(s, amax, kind);
  uint8_t* dst = q == nullptr ? nullptr : q + b * rows * cols + tr * kTile * cols + tc * kTile;
  uint32_t packed[8][2];  // row r0 + i: columns c8 .. c8 + 7, one byte each
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float v[8];
    unpack8(raw[i], v);
    const uint2 p = by.pack8(v);
    packed[i][0] = p.x, packed[i][1] = p.y;
    if (dst != nullptr)
      *reinterpret_cast<uint2*>(dst + static_cast<int64_t>(r0 + i) * cols + c8) = make_uint2(packed[i][0], packed[i][1]);
  }
  if (t == 0) scales[b * tiles_r * tiles_c + tr * tiles_c + tc] = s;
  if (q_t == nullptr) return;
  // The 8 x 8 bytes transposed in registers: column c8 + j is byte j of each row's pair.
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t col[2] = {0, 0};  // rows r0 .. r0 + 7 of column c8 + j
#pragma unroll
    for (int i = 0; i < 8; ++i) col[i / 4] |= ((packed[i][j / 4] >> (8 * (j % 4))) & 0xFFu) << (8 * (i % 4));
    *reinterpret_cast<uint2*>(&tile_t[c8 + j][r0]) = make_uint2(col[0], col[1]);
  }
  // q_t [batch, cols, rows]: row c of the transposed tile holds column c of the tile.
  store_transposed_tile(tile_t, q_t + b * cols * rows + tc * kTile * rows + tr * kTile, rows);
}

// One 256-thread block per 128 x 128 tile of x, quantised as 128 columns of
// 128 x 1 tiles (a weight-gradient operand: K = rows = tokens). Each thread
// holds 64 values as bf16: 8 consecutive rows r0 .. r0 + 7 (r0 = 8 (t / 16))
// x 8 columns c8 .. (c8 = 8 (t % 16)); the column amaxes meet in shared
// memory (16 partials per column); a thread's 8 e4m3 bytes of one column
// are 8 consecutive bytes of the transposed tile (one 8-byte shared store;
// the byte-wide form ran at ~1 TB/s), read back 8 bytes at a time so that
// the q_t rows (x's columns) are stored contiguously.
template <typename Source>
__global__ void __launch_bounds__(256) quantize_cols_t_kernel(const Source src, int64_t rows, int64_t cols,
                                                              Fp8Scale kind, uint8_t* q_t, float* scales) {
  __shared__ float partial[16][kTile];  // [row group][column]
  __shared__ float col_scale[kTile], col_amax[kTile];
  __shared__ __align__(8) uint8_t tile_t[kTile][kTransposePitch];  // [column][row]
  const int64_t tiles_c = cols / kTile;
  const int64_t tr = blockIdx.x / tiles_c, tc = blockIdx.x % tiles_c;
  if (src.skip(tr)) return;  // the whole block: no barrier is left waiting
  const int t = threadIdx.x, c8 = (t % 16) * 8, r0 = (t / 16) * 8;
  uint4 raw[8];
  src.load(tr, tc, cols, r0, c8, raw);
  // Column amaxes over this thread's 8 rows, on bf16 pairs (exact; NaN propagates).
  __nv_bfloat162 m[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) m[j] = __habs2(reinterpret_cast<const __nv_bfloat162*>(&raw[0])[j]);
#pragma unroll
  for (int i = 1; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) m[j] = __hmax2_nan(m[j], __habs2(reinterpret_cast<const __nv_bfloat162*>(&raw[i])[j]));
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(m[j]);
    partial[t / 16][c8 + 2 * j] = fold_amax(0.0f, f.x);  // (fold_amax: the canonical NaN)
    partial[t / 16][c8 + 2 * j + 1] = fold_amax(0.0f, f.y);
  }
  __syncthreads();
  if (t < kTile) {
    float mx = 0.0f;
    for (int g = 0; g < 16; ++g) mx = fold_amax(mx, partial[g][t]);
    const float sc = tile_scale(mx, kind);
    col_scale[t] = sc;
    col_amax[t] = mx;
    scales[tr * cols + tc * kTile + t] = sc;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 8; ++j) {  // column c8 + j: rows r0 .. r0 + 7, one byte each
    float col[8];  // unpacked a column at a time: the values stay bf16 in registers (occupancy)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(&raw[i])[j / 2]);
      col[i] = j % 2 == 0 ? f.x : f.y;
    }
    *reinterpret_cast<uint2*>(&tile_t[c8 + j][r0]) =
        E4m3Quotients(col_scale[c8 + j], col_amax[c8 + j], kind).pack8(col);
  }
  // q_t [cols, rows]: row c of the transposed tile holds column c of the tile.
  store_transposed_tile(tile_t, q_t + tc * kTile * rows + tr * kTile, rows);
}

Status check_shape(const char* what, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0 || rows % kTile != 0 || cols % kTile != 0)
    return invalid_argument(std::string(what) + ": rows = " + std::to_string(rows) +
                            " and cols = " + std::to_string(cols) + " must be positive multiples of 128");
  return Status::Ok();
}

// Blocks of the row quantizers: up to 8 per SM, which at their 64 registers
// (4 blocks an SM fit) run as two waves; beyond that the blocks stride.
unsigned row_blocks(int64_t tiles) {
  static const int sm_count = [] {  // thread-safe once; the machines' GPUs are alike
    int device = 0, n = 0;
    const bool ok = cudaGetDevice(&device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess && n > 0;
    return ok ? n : 132;
  }();
  const int64_t tiles_per_block = kTilesInFlight * (kRowThreads / 32);
  return static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((tiles + tiles_per_block - 1) / tiles_per_block, int64_t{8} * sm_count)));
}

// The row kernels number tiles in 32 bits (RowsSource, RowsToSlotsSource).
Status check_row_tiles(const char* what, int64_t rows, int64_t cols) {
  if (rows * (cols / kTile) >= (int64_t{1} << 32))
    return invalid_argument(std::string(what) + ": " + std::to_string(rows) + " rows of " + std::to_string(cols) +
                            " columns exceed 2^32 tiles");
  return Status::Ok();
}

}  // namespace

Status quantize_e4m3_rows(const void* x, int64_t rows, int64_t cols, Fp8Scale scale, uint8_t* q, float* scales,
                          cudaStream_t stream, RowScales layout, const int32_t* used_rows) {
  // Rows need not be a multiple of 128 here (1 x 128 tiles): only cols.
  if (rows <= 0 || cols <= 0 || cols % kTile != 0)
    return invalid_argument("fp8 row quantizer: rows = " + std::to_string(rows) + " must be positive and cols = " +
                            std::to_string(cols) + " a positive multiple of 128");
  if (x == nullptr || q == nullptr || scales == nullptr)
    return invalid_argument("fp8 row quantizer: a pointer is null");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(q) % 8 != 0)
    return invalid_argument("fp8 row quantizer: x must be 16-byte and q 8-byte aligned");
  MEGAMOE_RETURN_IF_ERROR(check_row_tiles("fp8 row quantizer", rows, cols));
  const int64_t tiles = rows * (cols / kTile);
  const ScaleIndex at{static_cast<uint32_t>(cols / kTile), rows, layout == RowScales::kByKBlock};
  quantize_rows_kernel<<<row_blocks(tiles), kRowThreads, 0, stream>>>(
      RowsSource{static_cast<const __nv_bfloat16*>(x), tiles, at, used_rows}, scale, q, scales);
  return cuda_status("fp8 row quantizer", cudaGetLastError());
}

Status quantize_e4m3_rows_to_slots(const void* x, int64_t rows, int64_t cols, Fp8Scale scale, void* slots,
                                   int64_t slot_bytes, cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || cols % kTile != 0)
    return invalid_argument("fp8 row quantizer to slots: rows = " + std::to_string(rows) + " must be >= 0 and cols = " +
                            std::to_string(cols) + " a positive multiple of 128");
  if (slot_bytes < e4m3_slot_bytes(cols) || slot_bytes % 16 != 0)
    return invalid_argument("fp8 row quantizer to slots: slot_bytes = " + std::to_string(slot_bytes) +
                            " must be a multiple of 16 holding " + std::to_string(e4m3_slot_bytes(cols)) +
                            " bytes (a row's e4m3 values and scales)");
  if (rows == 0) return Status::Ok();
  if (x == nullptr || slots == nullptr) return invalid_argument("fp8 row quantizer to slots: a pointer is null");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(slots) % 16 != 0)
    return invalid_argument("fp8 row quantizer to slots: x and the slots must be 16-byte aligned");
  MEGAMOE_RETURN_IF_ERROR(check_row_tiles("fp8 row quantizer to slots", rows, cols));
  const int64_t tiles = rows * (cols / kTile);
  quantize_rows_kernel<<<row_blocks(tiles), kRowThreads, 0, stream>>>(
      RowsToSlotsSource{static_cast<const __nv_bfloat16*>(x), tiles, static_cast<uint32_t>(cols / kTile), slot_bytes},
      scale, static_cast<uint8_t*>(slots), static_cast<float*>(slots));
  return cuda_status("fp8 row quantizer to slots", cudaGetLastError());
}

Status gather_quantize_e4m3_rows(const void* src, int64_t cols, const int32_t* row_src, int top_k,
                                 const int32_t* pool_rows, int64_t capacity, Fp8Scale scale, uint8_t* q,
                                 float* scales, void* pool, cudaStream_t stream, RowScales layout) {
  if (capacity <= 0 || cols <= 0 || cols % kTile != 0 || top_k <= 0)
    return invalid_argument("fp8 gathering row quantizer: capacity = " + std::to_string(capacity) + " and top_k = " +
                            std::to_string(top_k) + " must be positive, cols = " + std::to_string(cols) +
                            " a positive multiple of 128");
  if (src == nullptr || row_src == nullptr || pool_rows == nullptr || q == nullptr || scales == nullptr)
    return invalid_argument("fp8 gathering row quantizer: a pointer is null");
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0 || reinterpret_cast<uintptr_t>(pool) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 8 != 0)
    return invalid_argument("fp8 gathering row quantizer: src and pool must be 16-byte, q 8-byte aligned");
  if (capacity > (int64_t{1} << 31) / (cols / kTile))
    return invalid_argument("fp8 gathering row quantizer: " + std::to_string(capacity) + " rows of " +
                            std::to_string(cols) + " columns exceed 2^31 tiles");
  // The grid is sized for the capacity (the used rows are known on the device only) and strides.
  quantize_rows_kernel<<<row_blocks(capacity * (cols / kTile)), kRowThreads, 0, stream>>>(
      GatherSource{static_cast<const __nv_bfloat16*>(src), row_src, pool_rows, top_k,
                   static_cast<uint32_t>(cols / kTile), static_cast<uint4*>(pool),
                   ScaleIndex{static_cast<uint32_t>(cols / kTile), capacity, layout == RowScales::kByKBlock}},
      scale, q, scales);
  return cuda_status("fp8 gathering row quantizer", cudaGetLastError());
}

Status scatter_quantize_e4m3_rows(const void* src, int64_t tokens, int64_t cols, const int32_t* route_row, int top_k,
                                  const int32_t* row_src, const int32_t* pool_rows, int64_t capacity, Fp8Scale scale,
                                  uint8_t* q, float* scales, void* pool, cudaStream_t stream, RowScales layout) {
  if (tokens < 0 || capacity <= 0 || cols <= 0 || cols % kTile != 0 || top_k <= 0)
    return invalid_argument("fp8 scattering row quantizer: tokens = " + std::to_string(tokens) +
                            " must be >= 0, capacity = " + std::to_string(capacity) + " and top_k = " +
                            std::to_string(top_k) + " positive, cols = " + std::to_string(cols) +
                            " a positive multiple of 128");
  if (src == nullptr || route_row == nullptr || row_src == nullptr || pool_rows == nullptr || q == nullptr ||
      scales == nullptr)
    return invalid_argument("fp8 scattering row quantizer: a pointer is null");
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0 || reinterpret_cast<uintptr_t>(pool) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 8 != 0)
    return invalid_argument("fp8 scattering row quantizer: src and pool must be 16-byte, q 8-byte aligned");
  const int64_t segs = cols / kTile;
  if (capacity > (int64_t{1} << 31) / segs || tokens > (int64_t{1} << 31) / segs)
    return invalid_argument("fp8 scattering row quantizer: " + std::to_string(std::max(capacity, tokens)) +
                            " rows of " + std::to_string(cols) + " columns exceed 2^31 tiles");
  const ScaleIndex at{static_cast<uint32_t>(segs), capacity, layout == RowScales::kByKBlock};
  auto* pool16 = static_cast<uint4*>(pool);
  // Padding rows first: in one stream order with the token rows, which never land on them.
  zero_padding_rows_kernel<<<row_blocks(capacity * segs), kRowThreads, 0, stream>>>(
      row_src, pool_rows, static_cast<uint32_t>(segs), at, scale, q, scales, pool16);
  if (tokens > 0)
    scatter_quantize_rows_kernel<<<row_blocks(tokens * segs), kRowThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(src), tokens * segs,
        ScatterDests{route_row, pool_rows, top_k, static_cast<uint32_t>(segs), at, pool16}, scale, q, scales);
  return cuda_status("fp8 scattering row quantizer", cudaGetLastError());
}

Status quantize_e4m3_blocks(const void* w, int64_t batch, int64_t rows, int64_t cols, Fp8Scale scale, uint8_t* q,
                            uint8_t* q_t, float* scales, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_shape("fp8 block quantizer", rows, cols));
  if (batch <= 0)
    return invalid_argument("fp8 block quantizer: batch = " + std::to_string(batch) + " must be positive");
  if (w == nullptr || scales == nullptr || (q == nullptr && q_t == nullptr))
    return invalid_argument("fp8 block quantizer: w, scales and q or q_t (or both) must be given");
  if (reinterpret_cast<uintptr_t>(w) % 16 != 0 || reinterpret_cast<uintptr_t>(q) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(q_t) % 8 != 0)
    return invalid_argument("fp8 block quantizer: w must be 16-byte, q and q_t 8-byte aligned");
  const int64_t tiles = batch * (rows / kTile) * (cols / kTile);
  quantize_blocks_kernel<<<static_cast<unsigned>(tiles), 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(w), rows,
                                                                           cols, scale, q, q_t, scales);
  return cuda_status("fp8 block quantizer", cudaGetLastError());
}

Status quantize_e4m3_cols_t(const void* x, int64_t rows, int64_t cols, Fp8Scale scale, uint8_t* q_t, float* scales,
                            cudaStream_t stream, const int32_t* used_rows) {
  MEGAMOE_RETURN_IF_ERROR(check_shape("fp8 column quantizer", rows, cols));
  if (x == nullptr || q_t == nullptr || scales == nullptr)
    return invalid_argument("fp8 column quantizer: a pointer is null");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(q_t) % 8 != 0)
    return invalid_argument("fp8 column quantizer: x must be 16-byte and q_t 8-byte aligned");
  const int64_t tiles = (rows / kTile) * (cols / kTile);
  quantize_cols_t_kernel<<<static_cast<unsigned>(tiles), 256, 0, stream>>>(
      TileRows{static_cast<const __nv_bfloat16*>(x), used_rows}, rows, cols, scale, q_t, scales);
  return cuda_status("fp8 column quantizer", cudaGetLastError());
}

Status gather_quantize_e4m3_cols_t(const void* src, int64_t cols, const int32_t* row_src, int top_k,
                                   const int32_t* pool_rows, int64_t capacity, Fp8Scale scale, uint8_t* q_t,
                                   float* scales, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_shape("fp8 gathering column quantizer", capacity, cols));
  if (top_k <= 0) return invalid_argument("fp8 gathering column quantizer: top_k = " + std::to_string(top_k));
  if (src == nullptr || row_src == nullptr || pool_rows == nullptr || q_t == nullptr || scales == nullptr)
    return invalid_argument("fp8 gathering column quantizer: a pointer is null");
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0 || reinterpret_cast<uintptr_t>(q_t) % 8 != 0)
    return invalid_argument("fp8 gathering column quantizer: src must be 16-byte and q_t 8-byte aligned");
  const int64_t tiles = (capacity / kTile) * (cols / kTile);
  quantize_cols_t_kernel<<<static_cast<unsigned>(tiles), 256, 0, stream>>>(
      TileGather{static_cast<const __nv_bfloat16*>(src), row_src, pool_rows, top_k}, capacity, cols, scale, q_t,
      scales);
  return cuda_status("fp8 gathering column quantizer", cudaGetLastError());
}

}  // namespace megamoe::cuda
