// Errors that kernels find — bad routing (an expert id out of range, a token
// routed twice to one expert) and spin-waits that gave up — reported to the
// host without any synchronisation.
//
// Per device, the library keeps one DeviceErrorReport in host-mapped pinned
// memory and one claim word in device memory. The first failing kernel claims
// the word (atomicCAS 0 -> 1), fills the report and publishes `kind` last
// (__threadfence_system). The host reads the report at the entry of every
// megamoe call on that device (a plain load, no sync) and after a stream
// synchronisation in check / validate mode; taking a report clears it and
// frees the claim (an async memset on the caller's stream).
//
// Byte layout of DeviceErrorReport (host-mapped, 56 bytes):
//   kind u32 | kernel u32 | block u32 | barrier u32 | phase u32 | top_k u32 | num_experts u32 | pad u32
//   | key u64 (routing: (t*k + j) << 2 | PlanErrorKind) | value i64 (topk_idx there) | waited_ns u64
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "megamoe/status.h"

namespace megamoe::cuda {

enum DeviceErrorKind : uint32_t { kDeviceErrorNone = 0, kDeviceErrorRouting = 1, kDeviceErrorTimeout = 2 };

// Which kernel reported (names in device_errors.cu).
enum KernelId : uint32_t {
  kKernelRouting = 0,
  kKernelGemmGateUp,
  kKernelGemmDown,
  kKernelGemmDownGrad,
  kKernelGemmGateUpGrad,
  kKernelGemmWeightGrad,
  kKernelEpRouting,
  kKernelEpCombine,
  kKernelGemmGateUpWide,  // kGateUp in 128 x 256 tiles
  kKernelGemmDownWide,    // kDown in 128 x 256 tiles
  kKernelGemmGateUpGradWide,   // kGateUpGrad in 128 x 256 tiles
  kKernelGemmWeightGradWide,   // kWeightGrad in 128 x 256 tiles
  kKernelCount,
};

// Which barrier a timed-out wait was on (names in device_errors.cu).
// kBarrierRows: a grouped GEMM waiting for a pool tile's rows to arrive
// (GroupedGemmArgs::arrival); its phase is the pool tile.
// kBarrierPeer: a rank waiting for another rank's dispatch (expert
// parallelism); its phase is the rank that never arrived.
enum BarrierId : uint32_t {
  kBarrierFull = 0,
  kBarrierEmpty,
  kBarrierOrder,
  kBarrierRows,
  kBarrierPeer,
  kBarrierCount
};

struct DeviceErrorReport {
  volatile uint32_t kind;
  uint32_t kernel, block, barrier, phase, top_k, num_experts;
  uint64_t key;
  int64_t value;
  uint64_t waited_ns;
};

// Handed to kernels by value.
struct DeviceErrorSink {
  unsigned int* claim = nullptr;          // device memory; 0 = no error pending
  DeviceErrorReport* report = nullptr;    // device alias of the host-mapped report
  uint64_t timeout_ns = 10'000'000'000;  // bound of every spin-wait (10 s)
};

#ifdef __CUDACC__
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// The first error per device wins; later ones (often consequences) are dropped.
__device__ __forceinline__ bool claim_report(const DeviceErrorSink& sink) {
  return sink.claim != nullptr && atomicCAS(sink.claim, 0u, 1u) == 0u;
}

// Makes a filled-in report visible to the host: its fields first, then its kind
// (the host reads the kind, then the fields).
__device__ __forceinline__ void publish_report(DeviceErrorReport* r, uint32_t kind) {
  __threadfence_system();
  r->kind = kind;
  __threadfence_system();
}

__device__ __forceinline__ void report_timeout(const DeviceErrorSink& sink, uint32_t kernel, uint32_t barrier,
                                               uint32_t phase, uint64_t waited_ns) {
  if (!claim_report(sink)) return;
  DeviceErrorReport* r = sink.report;
  r->kernel = kernel;
  r->block = blockIdx.x;
  r->barrier = barrier;
  r->phase = phase;
  r->waited_ns = waited_ns;
  publish_report(r, kDeviceErrorTimeout);
}

__device__ __forceinline__ void report_routing(const DeviceErrorSink& sink, uint64_t key, int64_t value,
                                               uint32_t top_k, uint32_t num_experts) {
  if (!claim_report(sink)) return;
  DeviceErrorReport* r = sink.report;
  r->kernel = kKernelRouting;
  r->block = blockIdx.x;
  r->key = key;
  r->value = value;
  r->top_k = top_k;
  r->num_experts = num_experts;
  publish_report(r, kDeviceErrorRouting);
}
#endif

// The sink of `device` (created on first use: one pinned page and one device word).
Status device_error_sink(int device, DeviceErrorSink* out);

// Takes the pending report of `device`, if any: returns it as a Status naming
// what was found (Ok when none) and frees the claim on `stream`. No sync.
Status take_device_error(int device, cudaStream_t stream);

// Synchronises `stream`, then take_device_error.
Status sync_and_take_device_error(int device, cudaStream_t stream);

}  // namespace megamoe::cuda
