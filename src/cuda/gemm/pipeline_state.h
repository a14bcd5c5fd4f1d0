// The arithmetic of the engine's pipeline, host-callable so that a CPU model
// of the protocol (tests/cpu/pipeline_protocol_test.cpp) runs the very
// formulas the kernel runs. No CUDA here.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace megamoe::cuda::engine {

// The CTA's running stage iteration `it`: the producer and both consumers
// step it over every stage of every tile in the same order, so one counter
// names a ring slot (it % kStages) and the parity of its phase
// ((it / kStages) & 1) for all of them. Reports and debug_stall_at use it as
// the "phase" of a wait.
template <int kStages>
struct PipelineState {
  static_assert(kStages >= 2, "a ring needs two stages to overlap a load with a main-loop step");
  uint32_t it = 0;

  MEGAMOE_HD int stage() const { return static_cast<int>(it % kStages); }
  MEGAMOE_HD uint32_t parity() const { return (it / kStages) & 1; }
  // The producer waits on an empty barrier with the opposite parity: the
  // first pass over the ring finds every stage free.
  MEGAMOE_HD uint32_t empty_parity() const { return parity() ^ 1; }
  // The slot of the iteration before this one (the stage a consumer gives back).
  MEGAMOE_HD int previous_stage() const { return static_cast<int>((it + kStages - 1) % kStages); }
  MEGAMOE_HD void advance(uint32_t n) { it += n; }
  MEGAMOE_HD PipelineState& operator++() {
    ++it;
    return *this;
  }
};

// Ping-pong order of the two consumers' main loops: consumer 0's n-th tile
// follows consumer 1's (n-1)-th (phase n - 1 of order[0]); consumer 1's n-th
// follows consumer 0's n-th (phase n of order[1]). Consumer 0's first tile
// waits for nobody.
MEGAMOE_HD bool order_must_wait(int consumer, int mine) { return consumer != 0 || mine != 0; }
MEGAMOE_HD uint32_t order_parity(int consumer, int mine) {
  return static_cast<uint32_t>(consumer == 0 ? mine - 1 : mine) & 1;
}

}  // namespace megamoe::cuda::engine
