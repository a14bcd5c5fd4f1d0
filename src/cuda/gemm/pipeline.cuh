// Pipeline state and barriers of the grouped GEMM engine, as types: the ring
// of shared-memory stages (full / empty mbarriers), the running position in
// it, the consumers' ordering barriers, and the bounded wait every one of
// them goes through. Device code only; included by kernel.cuh.
#pragma once

#include <cstdint>

#include "cuda/common/device_errors.h"
#include "cuda/gemm/kernel_spec.h"
#include "cuda/gemm/pipeline_state.h"
#include "cuda/ptx/sm90.cuh"

namespace megamoe::cuda::engine {

using namespace ptx;  // the engine's device code calls the PTX wrappers unqualified

// ---- bounded waits ------------------------------------------------------------
// Every mbarrier wait of the kernel goes through BoundedWait::wait: poll
// try_wait (which itself suspends the thread for a hardware-chosen while);
// after a failed poll, look at the clock. A wait that has lasted longer than
// its bound sets the CTA's shared abort flag, reports (kernel, block,
// barrier, phase, waited) to the error sink (the first report per device
// wins) and returns false; so does, promptly, every other wait of the CTA
// that finds the flag set and its own barrier still incomplete kAbortGraceNs
// later. A caller that gets false returns from the kernel (a consumer first
// retires its wgmma groups). No trap: the CUDA context stays usable and the
// host learns of it from take_device_error (kTimeout).
//
// Bounds: full waits (the consumers waiting for loaded stages) and row waits
// (the producer waiting for a pool tile's rows to arrive: wait_counter) give
// up after timeout_ns; empty and order waits (the producer waiting for
// consumers, a consumer for the other one) after 2 x timeout_ns. Those are
// downstream of a stalled full wait, so the wait nearest the cause reports
// and the others then leave through the abort flag. A full wait is itself
// downstream of a row wait: while the producer holds for rows (bit 1 of the
// CTA's state word) a full wait past its bound keeps waiting, so the row wait
// reports and the full waits leave through the abort bit.
//
// The grace after seeing the flag: a thread leaves only when its barrier has
// not completed for that long, so a TMA load issued just before the abort has
// landed before the CTA's shared memory goes away (loads take microseconds).
//
// What stays unbounded: the named barriers of an epilogue (bar.sync among one
// consumer warpgroup) and the warpgroup-wide (.aligned) wgmma instructions
// cannot time out. All warps of a consumer warpgroup wait on the same
// mbarrier phase at the same place and give up there together; but if that
// phase completes in the instant between one warp giving up and another
// warp's next poll, the second warp goes on alone and can block for good in
// bar.sync or wgmma. That needs a phase to complete just as it times out,
// i.e. a pipeline that was seconds late rather than stuck.
inline constexpr uint64_t kAbortGraceNs = 1'000'000;  // 1 ms

struct BoundedWait {
  // The CTA's state word in shared memory: bit 0 (kAbort) set by the first
  // wait that gives up; bit 1 (kHoldingForRows) while the producer waits for
  // a tile's rows.
  static constexpr uint32_t kAbort = 1u, kHoldingForRows = 2u;
  const DeviceErrorSink& sink;
  uint32_t* cta_state;
  uint32_t kernel;  // the KernelId a report names
  // The kernel's producer may hold for rows (its kHoldRows instantiation): a
  // constant there, so the others compile without the check below.
  bool rows_may_hold;

  // An mbarrier phase (the ring's and the order barriers); `bar` its pointer,
  // or its shared-window address where the caller keeps that in a register
  // (the gathering producers). The polling loop is kept as it was before the
  // row waits existed: folding both kinds of wait into one templated loop
  // changed the M-grouped kernels' code.
  template <typename Bar>
  __device__ __forceinline__ bool wait(Bar bar, uint32_t parity, BarrierId barrier, uint32_t phase) const {
    if (ptx::mbar_try_wait(bar, parity)) return true;
    const uint64_t start = global_timer_ns();
    uint64_t leave_at = ~uint64_t{0};  // set once the abort bit is seen
    for (;;) {
      if (ptx::mbar_try_wait(bar, parity)) return true;
      const uint64_t now = global_timer_ns();
      if (now >= leave_at) return false;
      // Shared-memory atomics (slow path only): the word is read and written by
      // many threads with no barrier between them, by design.
      if (leave_at == ~uint64_t{0} && (atomicOr(cta_state, 0u) & kAbort) != 0u) leave_at = now + kAbortGraceNs;
      const uint64_t waited = now - start;
      if ((barrier == kBarrierFull ? waited : waited / 2) >= sink.timeout_ns) {
        // Past its bound a full wait keeps waiting while the producer holds
        // for rows: the row wait reports (read here only, off the polling path).
        if (rows_may_hold && barrier == kBarrierFull && (atomicOr(cta_state, 0u) & kHoldingForRows) != 0u) continue;
        atomicOr(cta_state, kAbort);
        report_timeout(sink, kernel, barrier, phase, waited);
        return false;
      }
    }
  }

  // Until *counter >= value (a release store or atomic by whoever delivers
  // the rows, on this GPU or a peer: read with system-scope acquire). Then the
  // rows it announces may be read by TMA: the proxy fence orders this
  // thread's acquire before its later async-proxy reads. `tile` names the
  // wait in a report.
  __device__ __forceinline__ bool wait_counter(const uint32_t* counter, uint32_t value, uint32_t tile) const {
    if (ptx::ld_acquire_sys(counter) < value) {
      atomicOr(cta_state, kHoldingForRows);
      const uint64_t start = global_timer_ns();
      uint64_t leave_at = ~uint64_t{0};
      bool in = false;
      for (;;) {
        if (ptx::ld_acquire_sys(counter) >= value) {
          in = true;
          break;
        }
        const uint64_t now = global_timer_ns();
        if (now >= leave_at) break;
        if (leave_at == ~uint64_t{0} && (atomicOr(cta_state, 0u) & kAbort) != 0u) leave_at = now + kAbortGraceNs;
        if (now - start >= sink.timeout_ns) {
          atomicOr(cta_state, kAbort);
          report_timeout(sink, kernel, kBarrierRows, tile, now - start);
          break;
        }
      }
      atomicAnd(cta_state, ~kHoldingForRows);
      if (!in) return false;
    }
    ptx::fence_proxy_async_global();
    return true;
  }
};

// The ring of shared-memory stages. Stage s is free (empty[s]: one arrival
// per warp of the consumer that used it, per lane with a scale ring) or
// loaded (full[s]: the producer's expect-tx arrival plus the TMA bytes). The
// producer and the consumers touch stages only through these four steps:
//   producer: acquire (wait until the slot is free), commit (arm its full
//             barrier with the bytes about to land; the loads signal it);
//   consumer: wait (until the slot holds its data), release (give it back).
// kStageBytes: one stage's data; with kScales, `scales` holds each stage's
// scale-ring slot (FP8 kWeightGrad), kScaleStageBytes each (else null).
template <int kStages, int kStageBytes, bool kScales>
struct StageRing {
  uint64_t* full;
  uint64_t* empty;
  uint8_t* stages;
  float* scales;

  __device__ __forceinline__ uint8_t* stage(int s) const { return stages + s * kStageBytes; }
  __device__ __forceinline__ float* stage_scales(int s) const {
    static_assert(kScales, "a ring without scale slots");
    return scales + s * (kScaleStageBytes / 4);
  }
  // The consumer-sized view of slots [first, first + kRing) (split rings: one consumer's).
  template <int kRing>
  __device__ __forceinline__ StageRing<kRing, kStageBytes, kScales> slice(int first) const {
    return {full + first, empty + first, stages + first * kStageBytes,
            kScales ? scales + first * (kScaleStageBytes / 4) : nullptr};
  }

  __device__ __forceinline__ bool producer_acquire(const BoundedWait& w, PipelineState<kStages> ps) const {
    return w.wait(&empty[ps.stage()], ps.empty_parity(), kBarrierEmpty, ps.it);
  }
  // Expects tx_bytes on slot s's full barrier, which the stage's loads then complete.
  __device__ __forceinline__ uint64_t* producer_commit(int s, uint32_t tx_bytes) const {
    ptx::mbar_arrive_expect_tx(&full[s], tx_bytes);
    return &full[s];
  }
  __device__ __forceinline__ bool consumer_wait(const BoundedWait& w, PipelineState<kStages> ps) const {
    return w.wait(&full[ps.stage()], ps.parity(), kBarrierFull, ps.it);
  }
  __device__ __forceinline__ void consumer_release(int s) const { ptx::mbar_arrive(&empty[s]); }
};

// Split rings (the FP8 kernels, kSplitRings): the S stages are two rings of
// S / 2, consumer c's at slots [c S / 2, c S / 2 + S / 2), each with its own
// PipelineState, and the consumers' main loops run at the same time. FP8's
// per-k-block promotion leaves the tensor cores idle between one
// warpgroup's wgmma groups; the other warpgroup's wgmmas fill those gaps
// (one shared ring serialises the main loops: see OrderBarriers). Each ring
// has its own producer thread (producer.cuh), so an epilogue still
// overlaps the other consumer's main loop and neither ring waits for the
// other's loads or tile look-ups.

// The consumers run their main loops in tile order, one at a time: a consumer
// starts waiting for its tile's stages only after the other has waited for
// all stages of the previous tile. Without that it could poll a stage whose
// previous use (it - kStages) has not completed yet, and a parity wait cannot
// tell those two phases apart (it would read the old contents). The phases:
// order_must_wait / order_parity (pipeline_state.h).
struct OrderBarriers {
  uint64_t* bar;  // [2]

  // Consumer cw before its tile number `mine` (0-based) whose first stage is `it`.
  __device__ __forceinline__ bool wait_turn(const BoundedWait& w, int cw, int mine, uint32_t it) const {
    if (!order_must_wait(cw, mine)) return true;
    return w.wait(&bar[cw], order_parity(cw, mine), kBarrierOrder, it);
  }
  // Consumer cw has waited for all stages of its tile: the other may start.
  __device__ __forceinline__ void pass_turn(int cw) const { ptx::mbar_arrive(&bar[cw ^ 1]); }
};

}  // namespace megamoe::cuda::engine
