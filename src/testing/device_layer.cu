#include "testing/device_layer.h"
#include "cuda/common/cuda_status.h"

#include <algorithm>
#include <string>

namespace megamoe::testing {

using cuda::cuda_status;

DeviceTensor::DeviceTensor(DType dtype, std::initializer_list<int64_t> shape, int device) {
  view_ = make_view(nullptr, dtype, shape, DeviceType::kCUDA, device);
  if (view_.size_bytes() > 0) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    if (cudaMalloc(&view_.data, static_cast<size_t>(view_.size_bytes())) != cudaSuccess) view_.data = nullptr;
    cudaSetDevice(prev);
  }
}
DeviceTensor::~DeviceTensor() {
  if (view_.data != nullptr) cudaFree(view_.data);
}
DeviceTensor::DeviceTensor(DeviceTensor&& o) noexcept : view_(o.view_) { o.view_.data = nullptr; }
DeviceTensor& DeviceTensor::operator=(DeviceTensor&& o) noexcept {
  if (this != &o) {
    if (view_.data != nullptr) cudaFree(view_.data);
    view_ = o.view_;
    o.view_.data = nullptr;
  }
  return *this;
}

Status DeviceTensor::upload(const HostTensor& h, cudaStream_t stream) {
  if (h.view.size_bytes() != view_.size_bytes()) return internal_error("upload: size mismatch");
  if (view_.size_bytes() == 0) return Status::Ok();
  if (view_.data == nullptr) return internal_error("upload: device allocation failed");
  return cuda_status("upload", cudaMemcpyAsync(view_.data, h.view.data, static_cast<size_t>(view_.size_bytes()),
                                               cudaMemcpyHostToDevice, stream));
}

Status DeviceTensor::download(HostTensor* h, cudaStream_t stream) const {
  if (h->view.size_bytes() != view_.size_bytes()) return internal_error("download: size mismatch");
  if (view_.size_bytes() == 0) return Status::Ok();
  MEGAMOE_RETURN_IF_ERROR(cuda_status("download", cudaMemcpyAsync(h->view.data, view_.data,
                                                                  static_cast<size_t>(view_.size_bytes()),
                                                                  cudaMemcpyDeviceToHost, stream)));
  return cuda_status("download sync", cudaStreamSynchronize(stream));
}

Status DeviceTensor::fill_bytes(int byte, cudaStream_t stream) {
  if (view_.size_bytes() == 0) return Status::Ok();
  return cuda_status("fill", cudaMemsetAsync(view_.data, byte, static_cast<size_t>(view_.size_bytes()), stream));
}

Status make_device_layer(const MoeProblem& p, const LayerData& data, DType wgrad_dtype, int device, DeviceLayer* d) {
  const int64_t T = p.num_tokens, H = p.hidden, I = p.intermediate, L = p.experts_per_rank();
  const int k = p.top_k;
  d->x = DeviceTensor(DType::kBF16, {T, H}, device);
  d->dy = DeviceTensor(DType::kBF16, {T, H}, device);
  d->topk_idx = DeviceTensor(DType::kI32, {T, k}, device);
  d->topk_weights = DeviceTensor(DType::kF32, {T, k}, device);
  d->w13 = DeviceTensor(DType::kBF16, {L, 2 * I, H}, device);
  d->w2 = DeviceTensor(DType::kBF16, {L, H, I}, device);
  d->y = DeviceTensor(DType::kBF16, {T, H}, device);
  d->dx = DeviceTensor(DType::kBF16, {T, H}, device);
  d->d_topk_weights = DeviceTensor(DType::kF32, {T, k}, device);
  d->dw13 = DeviceTensor(wgrad_dtype, {L, 2 * I, H}, device);
  d->dw2 = DeviceTensor(wgrad_dtype, {L, H, I}, device);
  MEGAMOE_RETURN_IF_ERROR(d->x.upload(data.x));
  MEGAMOE_RETURN_IF_ERROR(d->dy.upload(data.dy));
  MEGAMOE_RETURN_IF_ERROR(d->topk_idx.upload(data.topk_idx));
  MEGAMOE_RETURN_IF_ERROR(d->topk_weights.upload(data.topk_weights));
  MEGAMOE_RETURN_IF_ERROR(d->w13.upload(data.w13));
  MEGAMOE_RETURN_IF_ERROR(d->w2.upload(data.w2));
  return cuda_status("make_device_layer", cudaDeviceSynchronize());
}

Status poison_outputs(DeviceLayer& d, cudaStream_t stream) {
  for (DeviceTensor* t : {&d.y, &d.dx, &d.d_topk_weights, &d.dw13, &d.dw2})
    MEGAMOE_RETURN_IF_ERROR(t->fill_bytes(0xFF, stream));
  return Status::Ok();
}

Status download_outputs(const DeviceLayer& d, LayerOutputs* out) {
  MEGAMOE_RETURN_IF_ERROR(d.y.download(&out->y));
  MEGAMOE_RETURN_IF_ERROR(d.dx.download(&out->dx));
  MEGAMOE_RETURN_IF_ERROR(d.d_topk_weights.download(&out->d_topk_weights));
  MEGAMOE_RETURN_IF_ERROR(d.dw13.download(&out->dw13));
  return d.dw2.download(&out->dw2);
}

double median_ms(const std::function<void()>& fn, int warmup, int iters, cudaStream_t stream,
                 const std::function<void()>& setup) {
  for (int i = 0; i < warmup; ++i) {
    if (setup) setup();
    fn();
  }
  std::vector<float> ms;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < iters; ++i) {
    if (setup) setup();
    cudaEventRecord(a, stream);
    fn();
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms.empty() ? 0.0 : ms[ms.size() / 2];
}

MoeBuffers DeviceBuffers::view() const {
  MoeBuffers b;
  b.scratch = scratch.view().data;
  b.scratch_bytes = static_cast<size_t>(scratch.view().size_bytes());
  b.saved = saved.view().data;
  b.saved_bytes = static_cast<size_t>(saved.view().size_bytes());
  b.fp8_weights = fp8_weights.view().data;
  b.fp8_weights_bytes = static_cast<size_t>(fp8_weights.view().size_bytes());
  b.fp8_weights_ready = fp8_weights_ready;
  return b;
}

Status make_device_buffers(const MoeProblem& p, const MoeOptions& o, bool will_backward, int device,
                           DeviceBuffers* out) {
  MoeBufferSizes sizes;
  MEGAMOE_RETURN_IF_ERROR(moe_buffer_sizes(p, o, will_backward, &sizes));
  out->scratch = DeviceTensor(DType::kI32, {static_cast<int64_t>(sizes.scratch_bytes / 4)}, device);
  out->saved = DeviceTensor(DType::kI32, {static_cast<int64_t>(sizes.saved_bytes / 4)}, device);
  out->fp8_weights = DeviceTensor(DType::kI32, {static_cast<int64_t>(sizes.fp8_weights_bytes / 4)}, device);
  out->fp8_weights_ready = false;
  if ((sizes.scratch_bytes > 0 && out->scratch.view().data == nullptr) ||
      (sizes.saved_bytes > 0 && out->saved.view().data == nullptr) ||
      (sizes.fp8_weights_bytes > 0 && out->fp8_weights.view().data == nullptr))
    return capacity_error("cannot allocate the layer buffers (" + std::to_string(sizes.scratch_bytes >> 20) +
                          " MiB scratch, " + std::to_string(sizes.saved_bytes >> 20) + " MiB saved, " +
                          std::to_string(sizes.fp8_weights_bytes >> 20) + " MiB fp8 weights)");
  return Status::Ok();
}

}  // namespace megamoe::testing
