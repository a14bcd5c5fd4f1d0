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
//   xdy_pool      bf16 [C, H]       forward: pooled x; backward: pooled dy, then pooled x again (dW13)
//   a_pool        bf16 [C, I]       forward: silu(g) u; backward: topk_w * a (the dW2 operand)
//   dz_pool       bf16 [C, 2I]      backward only
//   dw_partial    f32  [C, I / 128] backward only: per-tile partial sums of d topk_w
//   slots         bf16 [k, T, H]    forward: weighted expert outputs; backward: dx rows.
//                                   Last, and absent (bytes_without_slots) from an
//                                   expert-parallel owner's scratch: its GEMMs write
//                                   these rows into the source ranks' return areas.
#pragma once

#include <cstddef>
#include <cstdint>

#include "megamoe/status.h"

namespace megamoe {

inline constexpr int kPlanChunk = 256;  // tokens per chunk of the plan's count/assign kernels
inline constexpr size_t kBufferAlign = 256;

struct LayerDims {
  int64_t tokens = 0, hidden = 0, intermediate = 0;
  int num_experts = 0, top_k = 0;
};

struct Region {
  size_t offset = 0, bytes = 0;
};

struct SavedLayout {
  Region error_key, expert_rows, expert_offset, tile_expert, route_row, row_src, z_pool;
  size_t bytes = 0;
};

struct ScratchLayout {
  Region chunk_counts;
  bool holds_plan = false;  // the saved layout lives here (at plan_offset)
  size_t plan_offset = 0;
  SavedLayout plan;         // offsets relative to plan_offset
  Region xdy_pool, a_pool, dz_pool, dw_partial, slots;
  size_t bytes = 0;
  size_t bytes_without_slots = 0;  // = slots.offset
};

// Pool capacity C for `dims`; fails (naming the sizes) when a byte count would
// overflow 64 bits or an index 31 bits (the kernels index pool rows as int32).
Status pool_capacity(const LayerDims& dims, int64_t* rows);
Status saved_layout(const LayerDims& dims, SavedLayout* out);
Status scratch_layout(const LayerDims& dims, bool holds_plan, ScratchLayout* out);

}  // namespace megamoe
