#include "cuda/layer/layer_call.h"

#include <string>

#include "cuda/plan/device_plan.h"

namespace megamoe::cuda {

Status check_hopper(int device) {
  static int verdict[64] = {};  // 0 unknown, 1 Hopper, 2 not
  if (device < 0 || device >= 64) return invalid_argument("device: " + std::to_string(device) + " out of range");
  if (verdict[device] == 0) {
    cudaDeviceProp prop{};
    const cudaError_t err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess)
      return unavailable("backend cuda: device " + std::to_string(device) + ": " + cudaGetErrorString(err));
    verdict[device] = prop.major == 9 && prop.minor == 0 ? 1 : 2;
    if (verdict[device] == 2)
      return unimplemented("backend cuda: the kernels need a Hopper GPU (sm_90), device " + std::to_string(device) +
                           " is " + prop.name + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
                           ")");
  }
  return verdict[device] == 1 ? Status::Ok() : unimplemented("backend cuda: the kernels need a Hopper GPU (sm_90)");
}

int sm_count(int device) {
  static int counts[64] = {};
  if (device < 0 || device >= 64) return 132;
  if (counts[device] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    counts[device] = n > 0 ? n : 132;
  }
  return counts[device];
}

bool fp8_forward(const LayerDims& d) { return d.precision == Precision::kFP8; }
bool fp8_backward(const LayerDims& d) { return d.precision == Precision::kFP8 || d.precision == Precision::kFP8Bwd; }
Fp8Scale fp8_scale_of(const LayerDims& d) {
  return d.fp8_scale == ScaleMode::kPowerOfTwo ? Fp8Scale::kPowerOfTwo : Fp8Scale::kFloat32;
}

Status prepare_layer_call(const LayerDims& dims, int device, cudaStream_t stream, const LayerBuffers& buffers,
                          LayerCall* call, bool slots_at_sources) {
  if (dims.top_k > kMaxTopK)
    return invalid_argument("top_k = " + std::to_string(dims.top_k) + " exceeds the CUDA backend's limit of " +
                            std::to_string(kMaxTopK));
  ScratchLayout sl;
  MEGAMOE_RETURN_IF_ERROR(scratch_layout(dims, buffers.saved == nullptr, &sl, slots_at_sources));
  const size_t need = slots_at_sources ? sl.bytes_without_slots : sl.bytes;
  if (buffers.scratch == nullptr || buffers.scratch_bytes < need)
    return capacity_error("scratch: " + std::to_string(buffers.scratch_bytes) + " bytes given, this call (" +
                          std::to_string(dims.tokens) + " tokens) needs " + std::to_string(need) +
                          " (moe_buffer_sizes)");
  if (buffers.saved != nullptr) {
    SavedLayout s;
    MEGAMOE_RETURN_IF_ERROR(saved_layout(dims, &s));
    if (buffers.saved_bytes != s.bytes)
      return invalid_argument("saved: " + std::to_string(buffers.saved_bytes) + " bytes given, a call of " +
                              std::to_string(dims.tokens) + " tokens saves exactly " + std::to_string(s.bytes) +
                              " (moe_buffer_sizes)");
  }
  for (const void* p : {buffers.scratch, buffers.saved})
    if (reinterpret_cast<uintptr_t>(p) % kBufferAlign != 0)
      return invalid_argument("scratch, saved: device buffers must be 256-byte aligned");
  MEGAMOE_RETURN_IF_ERROR(check_hopper(device));
  call->slots_at_sources = slots_at_sources;
  call->dims = dims;
  call->device = device;
  call->stream = stream;
  const uint64_t timeout = call->errors.timeout_ns;
  MEGAMOE_RETURN_IF_ERROR(device_error_sink(device, &call->errors));
  call->errors.timeout_ns = timeout;
  return Status::Ok();
}

}  // namespace megamoe::cuda
