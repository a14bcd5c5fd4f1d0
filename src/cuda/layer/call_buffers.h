// One call's device buffers as pointers, carved once per call from the
// caller's scratch, saved and FP8 weight buffers (their byte layouts:
// core/layer_buffers.h). Regions the call's precision or role does not use
// are null. Host code.
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/layer/layer_call.h"
#include "cuda/plan/device_plan.h"

namespace megamoe::cuda {

// The FP8 operands quantised in each call (core/layer_buffers.h, Fp8Layout):
// e4m3 rows (1 x 128 tiles along K) and transposed columns (128 pool rows of
// one channel a tile), with their f32 scales. Four sets share one area.
struct Fp8Operands {
  uint8_t *x_q, *a_q, *dy_q, *dz_q, *dy_t, *wa_t, *dz_t, *x_t;
  float *x_s, *a_s, *dy_s, *dz_s, *dy_ts, *wa_ts, *dz_ts, *x_ts;
};

// The layer's e4m3 weights (Fp8WeightLayout): as given (fp8's forward) and
// transposed (every FP8 backward), one f32 scale per 128 x 128 block.
struct Fp8WeightRegions {
  uint8_t *w13_q, *w2_q, *w13_t, *w2_t;
  float *w13_s, *w2_s;
};

struct CallBuffers {
  int64_t capacity = 0;           // C: pool rows
  DevicePlanBuffers plan{};       // the routing plan: in the saved buffer, or in scratch
  DevicePlan gemm_plan;           // the same, as the GEMMs read it
  void* z_pool = nullptr;         // bf16 [C, 2I]: GEMM1's output (saved, or in scratch)
  // bf16 [C, H]: the H-wide pool. Forward: x's rows, then kDown's pool-order
  // rows; backward: dy's rows, then x's again (dW13). Null in the one-GPU fp8
  // layer (its e4m3 operands come from the token rows).
  void* hidden_pool = nullptr;
  void* a_pool = nullptr;         // bf16 [C, I]: forward a = silu(g) u; backward w a (dW2's operand)
  void* dz_pool = nullptr;        // bf16 [C, 2I]
  float* dw_partial = nullptr;    // f32 [C, I / 128]; forward: u32 [C / 128] kGateUp's row counts (side gather)
  void* slots = nullptr;          // bf16 [k, T, H] (null: an expert-parallel owner's)
  Fp8Operands fp8{};
  Fp8WeightRegions fp8_weights{};
};

Status carve_call_buffers(const LayerCall& call, const LayerBuffers& buffers, CallBuffers* out);
// The weight regions alone, from an FP8 weight buffer (null: left null).
Status carve_fp8_weights(const LayerDims& dims, void* buffer, Fp8WeightRegions* out);

}  // namespace megamoe::cuda
