// The MoE layer on one GPU (EP size 1), BF16: device routing plan -> gather
// into the expert-major pool -> GEMM1 + SwiGLU -> GEMM2 + routing weight into
// combine slots -> fixed-order slot sum; the backward in reverse plus the
// K-grouped weight gradients. No host synchronisation, no per-expert host
// loop, no float atomics: the whole forward + backward is graph-capturable.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "megamoe/status.h"
#include "megamoe/types.h"

namespace megamoe::cuda {

struct LayerShape {
  int64_t hidden = 0, intermediate = 0;
  int num_experts = 0, top_k = 0;
  int64_t max_tokens = 0;
};

// Device pointers of one call (bf16 unless noted).
struct LayerInputs {
  const void* x;
  const int32_t* topk_idx;
  const float* topk_weights;
  const void* w13;
  const void* w2;
};

struct LayerGrads {
  void* dx;
  float* d_topk_weights;
  void* dw13;
  void* dw2;
  bool wgrad_f32;   // dw13/dw2 are fp32 (else bf16)
  bool accumulate;  // fp32 only: add to dw13/dw2
};

class LayerWorkspace {
 public:
  // Allocates the workspace (the only allocation) on `device`.
  static Status create(const LayerShape& shape, int device, std::unique_ptr<LayerWorkspace>* out);
  static size_t bytes_for(const LayerShape& shape);
  ~LayerWorkspace();
  LayerWorkspace(const LayerWorkspace&) = delete;
  LayerWorkspace& operator=(const LayerWorkspace&) = delete;

  size_t bytes() const { return bytes_; }
  const LayerShape& shape() const { return shape_; }
  int device() const { return device_; }
  // Incremented by every forward; a backward checks it against its forward's.
  uint64_t epoch() const { return epoch_; }

  Status forward(int64_t num_tokens, const LayerInputs& in, void* y, SavePolicy policy, cudaStream_t stream);
  Status backward(int64_t num_tokens, const LayerInputs& in, const void* dy, const LayerGrads& grads,
                  SavePolicy policy, cudaStream_t stream);
  // Synchronises `stream` and turns a routing error the device found into a Status.
  Status check_device_errors(cudaStream_t stream, int top_k) const;

  struct Buffers;  // the carve-out (cuda_layer.cu)

 private:
  LayerWorkspace() = default;
  LayerShape shape_;
  int device_ = 0, num_sms_ = 0;
  size_t bytes_ = 0;
  uint64_t epoch_ = 0;
  void* base_ = nullptr;
  std::unique_ptr<Buffers> buf_;
};

}  // namespace megamoe::cuda
