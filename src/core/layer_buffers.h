// Byte layouts of the two device buffers of one CUDA layer call (P = 1), for
// T tokens. Pure arithmetic: the CPU-only build and the Python package (which
// allocates the buffers through PyTorch) use the same numbers.
//
// C = pool capacity rows = align128(T * min(k, E) + 127 * E): the exact worst
// case of the expert-major pool (every expert padded to 128 rows). Every
// region starts on a 256-byte boundary; offsets are from the buffer's start.
//
// saved — what a forward leaves for its backward (save policy keep; absent
// with recompute or when no backward follows):
//   error_key     u64  [1]          min over bad routes of ((t*k + j) << 2 | kind)
//   expert_rows   i32  [E]
//   expert_offset i32  [E + 1]      [E] = pool rows used (multiple of 128)
//   tile_expert   i32  [C / 128]
//   route_row     i32  [T, k]       pool row of route (t, j), -1 = none
//   row_src       i32  [C]          t * k + j of each pool row, -1 = padding
//   z_pool        bf16 [C, 2I]      GEMM1 output [g | u]
//
// scratch — needed during one call only; one buffer per device and stream
// serves every layer (calls on a stream run one after another):
//   chunk_counts  i32  [ceil(T / 256), E]
//   plan          the saved layout above, when the call has no saved buffer
//   hidden_pool   bf16 [C, H]       forward: pooled x, then kDown's weighted rows in pool order
//                                   (CudaPaths::down_to_pool); backward: pooled dy, then pooled x
//                                   again (dW13). Empty for the one-GPU fp8 layer (its e4m3 operands
//                                   come from the token rows); fp8_bwd's bf16 forward and
//                                   expert-parallel owners (the backward's rows arrive in bf16) have it
//   a_pool        bf16 [C, I]       forward: silu(g) u; backward: topk_w * a (the dW2 operand)
//   dz_pool       bf16 [C, 2I]      backward only
//   dw_partial    f32  [C, I / 128] backward: per-tile partial sums of d topk_w. Forward (side
//                                   jobs, bf16): u32 [C / 128] counts of kGateUp's rows in,
//                                   per row tile (its side gather)
//   fp8           FP8 precisions only (Fp8Layout below): the e4m3 activation and
//                 gradient operands and their scales, quantised in each call (empty
//                 for bf16), in four sets that share one area (each is dead before
//                 the next is written). The e4m3 weights live in a buffer of their
//                 own (Fp8WeightLayout), kept by the caller across calls.
//   slots         bf16 [k, T, H]    forward: weighted expert outputs; backward: dx rows.
//                                   Last, and absent (bytes_without_slots) from an
//                                   expert-parallel owner's scratch: its GEMMs write
//                                   these rows into the source ranks' return areas.
#pragma once

#include <cstddef>
#include <cstdint>

#include "megamoe/status.h"
#include "megamoe/types.h"

namespace megamoe {

inline constexpr int kPlanChunk = 256;  // tokens per chunk of the plan's count/assign kernels
inline constexpr size_t kBufferAlign = 256;

struct LayerDims {
  int64_t tokens = 0, hidden = 0, intermediate = 0;
  int num_experts = 0, top_k = 0;
  // FP8 (e4m3, block scales) GEMMs: fp8 both ways, fp8_bwd in the backward only.
  Precision precision = Precision::kBF16;
  ScaleMode fp8_scale = ScaleMode::kFloat32;
};

struct Region {
  size_t offset = 0, bytes = 0;
};

struct SavedLayout {
  Region error_key, expert_rows, expert_offset, tile_expert, route_row, row_src, z_pool;
  size_t bytes = 0;
};

// FP8 operands of one call (the recipe: reference/numerics.h; quantizers:
// cuda/fp8/quantize.h), e4m3 u8 with f32 scales; empty regions where the
// precision does not use them. Four sets, in the order a call uses them; each
// set's regions are disjoint, and every set starts at the same offset (the
// area is the largest set: at Qwen3-235B-A22B, 16384 tokens, 1.1 GB instead
// of 3.9 GB):
//   1 GEMM1 and GEMM2 (fp8; the forward, or a backward that recomputes GEMM1):
//       x_q [C, H] + x_s [C, H/128], a_q [C, I] + a_s [C, I/128]
//   2 data gradients (fp8, fp8_bwd): dy_q [C, H] + dy_s, dz_q [C, 2I] + dz_s (rows, 1 x 128)
//   3 dW2, 4 dW13 (fp8, fp8_bwd): weight-gradient operands transposed, per
//       128 pool rows of each channel: dy_t [H, C] + dy_ts [C/128, H], wa_t
//       [I, C] + wa_ts (3); dz_t [2I, C] + dz_ts, x_t [H, C] + x_ts (4)
struct Fp8Layout {
  Region x_q, x_s, a_q, a_s, dy_q, dy_s, dz_q, dz_s, dy_t, dy_ts, wa_t, wa_ts, dz_t, dz_ts, x_t, x_ts;
};

// The FP8 weight buffer (MoeBuffers::fp8_weights): a layer's expert weights in
// e4m3, 128 x 128 blocks, in both orientations its GEMMs read K-major; one
// f32 scale per block serves both orientations. Filled by a call whose
// buffer is not marked ready, then reused by the caller until the weights
// change (once per optimizer step). Depends on E, H, I and the precision only.
//   w13_s [E, 2I/128, H/128], w2_s [E, H/128, I/128]     fp8, fp8_bwd
//   w13_q [E, 2I, H], w2_q [E, H, I]  (as given: GEMM1, GEMM2)   fp8 only
//   w13_t [E, H, 2I], w2_t [E, I, H]  (transposed: the backward's data gradients)   fp8, fp8_bwd
struct Fp8WeightLayout {
  Region w13_s, w2_s, w13_q, w2_q, w13_t, w2_t;
  size_t bytes = 0;  // 0 for bf16
};
Status fp8_weight_layout(const LayerDims& dims, Fp8WeightLayout* out);

struct ScratchLayout {
  Region chunk_counts;
  bool holds_plan = false;  // the saved layout lives here (at plan_offset)
  size_t plan_offset = 0;
  SavedLayout plan;         // offsets relative to plan_offset
  Region hidden_pool, a_pool, dz_pool, dw_partial;
  Fp8Layout fp8;
  Region slots;
  size_t bytes = 0;
  size_t bytes_without_slots = 0;  // = slots.offset
};

// Pool capacity C for `dims`; fails (naming the sizes) when a byte count would
// overflow 64 bits or an index 31 bits (the kernels index pool rows as int32).
Status pool_capacity(const LayerDims& dims, int64_t* rows);
Status saved_layout(const LayerDims& dims, SavedLayout* out);
// ep_owner: the layout of an expert-parallel owner's call (LayerCall::
// slots_at_sources), whose pool receives rows: the bf16 x/dy pool in every
// precision. Otherwise fp8 has none (see hidden_pool above).
Status scratch_layout(const LayerDims& dims, bool holds_plan, ScratchLayout* out, bool ep_owner = false);

}  // namespace megamoe
