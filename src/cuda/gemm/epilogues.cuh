// The fused epilogues, one per mode behind one interface:
//   Epilogue<Spec>{}(params, tile, acc, ctx, cw) -> false when a wait gave up
// turns consumer cw's finished fp32 tile (128 x 128: acc[h] its rows
// [64h, 64h + 64); 128 x 256: its rows [64cw, 64cw + 64), acc[h] their
// columns [128h, 128h + 128)) into the mode's outputs (GemmOutputs). Device
// code; included by kernel.cuh.
#pragma once

#include <type_traits>

#include "cuda/gemm/epilogue_down_grad.cuh"
#include "cuda/gemm/epilogue_gate_up.cuh"
#include "cuda/gemm/epilogue_slots.cuh"
#include "cuda/gemm/epilogue_weight_grad.cuh"

namespace megamoe::cuda::engine {

template <typename Spec, GemmMode M = Spec::kMode>
struct EpilogueFor;
template <typename Spec>
struct EpilogueFor<Spec, GemmMode::kGateUp> {
  using type = std::conditional_t<Spec::kWide, WideGateUpEpilogue, Fp8GateUpEpilogue>;
};
template <typename Spec>
struct EpilogueFor<Spec, GemmMode::kDown> {
  using type = std::conditional_t<Spec::kWide, WideDownEpilogue, SlotEpilogue<GemmMode::kDown, Spec::kFp8>>;
};
template <typename Spec>
struct EpilogueFor<Spec, GemmMode::kGateUpGrad> {
  using type = std::conditional_t<Spec::kWide, WideSlotEpilogue<GemmMode::kGateUpGrad>,
                                  SlotEpilogue<GemmMode::kGateUpGrad, Spec::kFp8>>;
};
template <typename Spec>
struct EpilogueFor<Spec, GemmMode::kDownGrad> {
  using type = DownGradEpilogue;
};
template <typename Spec>
struct EpilogueFor<Spec, GemmMode::kWeightGrad> {
  using type = WeightGradEpilogue<Spec::kWide>;
};
template <typename Spec>
using Epilogue = typename EpilogueFor<Spec>::type;

}  // namespace megamoe::cuda::engine
