#include "cuda/common/device_errors.h"
#include "cuda/common/cuda_status.h"

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "cuda/plan/device_plan.h"

namespace megamoe::cuda {
namespace {

const char* kernel_name(uint32_t k) {
  static const char* const kNames[kKernelCount] = {"routing plan", "grouped GEMM kGateUp", "grouped GEMM kDown",
                                                   "grouped GEMM kDownGrad", "grouped GEMM kGateUpGrad",
                                                   "grouped GEMM kWeightGrad", "EP routing", "EP combine",
                                                   "grouped GEMM kGateUp (128 x 256 tiles)",
                                                   "grouped GEMM kDown (128 x 256 tiles)",
                                                   "grouped GEMM kGateUpGrad (128 x 256 tiles)",
                                                   "grouped GEMM kWeightGrad (128 x 256 tiles)"};
  return k < kKernelCount ? kNames[k] : "unknown kernel";
}

const char* barrier_name(uint32_t b) {
  static const char* const kNames[kBarrierCount] = {"full", "empty", "order", "row arrival", "peer arrival"};
  return b < kBarrierCount ? kNames[b] : "unknown";
}

struct PerDevice {
  DeviceErrorReport* host = nullptr;  // host-mapped
  DeviceErrorSink sink;
};

std::mutex g_mutex;
constexpr int kMaxDevices = 64;
PerDevice g_devices[kMaxDevices];  // entries live until the process ends (their pinned pages too)

Status cuda_status(const char* what, cudaError_t err) { return cuda::cuda_status(std::string("device errors: ") + what, err); }

Status get(int device, PerDevice** out) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (device < 0 || device >= kMaxDevices)
    return invalid_argument("device: " + std::to_string(device) + " is not a CUDA device ordinal");
  PerDevice& d = g_devices[device];
  if (d.host == nullptr) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaError_t err = cudaSetDevice(device);
    void* host = nullptr;
    if (err == cudaSuccess) err = cudaHostAlloc(&host, sizeof(DeviceErrorReport), cudaHostAllocMapped | cudaHostAllocPortable);
    if (err == cudaSuccess) {
      std::memset(host, 0, sizeof(DeviceErrorReport));
      err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&d.sink.report), host, 0);
    }
    if (err == cudaSuccess) err = cudaMalloc(&d.sink.claim, sizeof(unsigned int));
    if (err == cudaSuccess) err = cudaMemset(d.sink.claim, 0, sizeof(unsigned int));
    cudaSetDevice(prev);
    if (err != cudaSuccess) {
      if (host != nullptr) cudaFreeHost(host);
      d = PerDevice{};
      return cuda_status("allocate the report", err);
    }
    d.host = static_cast<DeviceErrorReport*>(host);
  }
  *out = &d;
  return Status::Ok();
}

Status describe(const DeviceErrorReport& r, int device) {
  const std::string on = " (found on cuda:" + std::to_string(device) + " in a megamoe call";
  if (r.kind == kDeviceErrorTimeout && r.barrier == kBarrierRows) {
    return timeout_error(std::string(kernel_name(r.kernel)) + ", block " + std::to_string(r.block) +
                         ": the rows of pool tile " + std::to_string(r.phase) +
                         " never arrived (held rows): the wait gave up after " + std::to_string(r.waited_ns / 1000000) +
                         " ms" + on + "; the kernel exited, its outputs are undefined)");
  }
  if (r.kind == kDeviceErrorTimeout && r.barrier == kBarrierPeer) {
    return timeout_error(std::string(kernel_name(r.kernel)) + ": rank " + std::to_string(r.phase) +
                         " never delivered its part (is it in the call?): the wait gave up after " +
                         std::to_string(r.waited_ns / 1000000) + " ms" + on + "; its outputs are undefined)");
  }
  if (r.kind == kDeviceErrorTimeout) {
    return timeout_error(std::string(kernel_name(r.kernel)) + ", block " + std::to_string(r.block) + ": the wait on " +
                         barrier_name(r.barrier) + " barrier phase " + std::to_string(r.phase) + " gave up after " +
                         std::to_string(r.waited_ns / 1000000) + " ms" + on +
                         "; the kernel exited, its outputs are undefined)");
  }
  const uint64_t route = r.key >> 2;
  const uint32_t k = r.top_k == 0 ? 1 : r.top_k;
  const std::string where = "topk_idx[" + std::to_string(route / k) + "," + std::to_string(route % k) + "]";
  if ((r.key & 3) == kPlanErrorOutOfRange) {
    // The Python binding narrows int64 ids to int32 by saturating, so a limit value may stand for a larger one.
    const bool at_limit = r.value == INT32_MIN || r.value == INT32_MAX;
    return invalid_argument(where + " = " + std::to_string(r.value) +
                            (at_limit ? " (or beyond: int64 ids are saturated to int32)" : "") +
                            " is out of range [-1, num_experts = " + std::to_string(r.num_experts) + ")" + on +
                            "; its outputs were set to NaN)");
  }
  return invalid_argument("token " + std::to_string(route / k) + " is routed twice to expert " +
                          std::to_string(r.value) + " (" + where + " repeats an earlier slot" + on +
                          "; its outputs were set to NaN)");
}

}  // namespace

Status device_error_sink(int device, DeviceErrorSink* out) {
  PerDevice* d;
  MEGAMOE_RETURN_IF_ERROR(get(device, &d));
  *out = d->sink;
  return Status::Ok();
}

Status take_device_error(int device, cudaStream_t stream) {
  PerDevice* d;
  MEGAMOE_RETURN_IF_ERROR(get(device, &d));
  if (d->host->kind == kDeviceErrorNone) return Status::Ok();
  DeviceErrorReport r;
  std::memcpy(&r, const_cast<const DeviceErrorReport*>(d->host), sizeof r);
  std::memset(d->host, 0, sizeof(DeviceErrorReport));
  // Later kernels on `stream` may claim again once this memset has run.
  const cudaError_t err = cudaMemsetAsync(d->sink.claim, 0, sizeof(unsigned int), stream);
  if (err != cudaSuccess) return cuda_status("reset the claim", err);
  return describe(r, device);
}

Status sync_and_take_device_error(int device, cudaStream_t stream) {
  const cudaError_t err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return cuda_status("stream synchronize", err);
  return take_device_error(device, stream);
}

}  // namespace megamoe::cuda
