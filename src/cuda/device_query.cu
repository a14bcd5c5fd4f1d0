#include <cuda_runtime.h>
#include <unistd.h>

#include "cuda/device_query.h"

namespace megamoe::cuda {

int device_count(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    // Without any NVIDIA driver the runtime says "driver version is insufficient": say what it means.
    const bool no_driver = access("/proc/driver/nvidia/version", F_OK) != 0;
    if (why) {
      if (err == cudaErrorNoDevice || (err == cudaErrorInsufficientDriver && no_driver))
        *why = "no CUDA GPU found (no NVIDIA GPU or driver on this machine)";
      else
        *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    }
    cudaGetLastError();  // clear the sticky error so later probes start clean
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device found";
  return n;
}

std::string device_description(int index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) return "unknown device";
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ")";
}

}  // namespace megamoe::cuda
