// Device copies of a layer's inputs and outputs (CUDA builds only), shared by
// the CLI, the benchmark and the GPU tests, plus CUDA-event timing.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <vector>

#include "testing/random_layer.h"

namespace megamoe::testing {

class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(DType dtype, std::initializer_list<int64_t> shape, int device = 0);
  ~DeviceTensor();
  DeviceTensor(DeviceTensor&& o) noexcept;
  DeviceTensor& operator=(DeviceTensor&& o) noexcept;
  const TensorView& view() const { return view_; }
  Status upload(const HostTensor& h, cudaStream_t stream = nullptr);
  Status download(HostTensor* h, cudaStream_t stream = nullptr) const;  // h must have the same shape and dtype
  Status fill_bytes(int byte, cudaStream_t stream = nullptr);           // e.g. 0xFF poisons bf16/f32 with NaN

 private:
  TensorView view_;
};

struct DeviceLayer {
  DeviceTensor x, topk_idx, topk_weights, w13, w2, dy;
  DeviceTensor y, dx, d_topk_weights, dw13, dw2;
  MoeInputs inputs() const { return {x.view(), topk_idx.view(), topk_weights.view(), w13.view(), w2.view()}; }
  MoeGrads grads() const { return {dx.view(), d_topk_weights.view(), dw13.view(), dw2.view()}; }
};

// The CUDA layer's buffers (scratch, saved, and the FP8 weights of an FP8
// precision), sized by moe_buffer_sizes; stored as i32 tensors of bytes / 4
// elements. fp8_weights_ready goes into view(): false (each call quantises
// the weights) until the caller sets it.
struct DeviceBuffers {
  DeviceTensor scratch, saved, fp8_weights;
  bool fp8_weights_ready = false;
  MoeBuffers view() const;
};
Status make_device_buffers(const MoeProblem& p, const MoeOptions& o, bool will_backward, int device,
                           DeviceBuffers* out);

// Uploads `data` and allocates outputs (weight grads in `wgrad_dtype`) on `device`.
Status make_device_layer(const MoeProblem& p, const LayerData& data, DType wgrad_dtype, int device, DeviceLayer* out);
// Poisons every output with NaN bytes.
Status poison_outputs(DeviceLayer& d, cudaStream_t stream);
// Copies the outputs into host tensors of the same shapes.
Status download_outputs(const DeviceLayer& d, LayerOutputs* out);

// Median milliseconds of `iters` runs of fn (after `warmup` runs), timed with
// CUDA events on `stream`; `setup` (if any) runs untimed before each run.
double median_ms(const std::function<void()>& fn, int warmup, int iters, cudaStream_t stream,
                 const std::function<void()>& setup = nullptr);

}  // namespace megamoe::testing
