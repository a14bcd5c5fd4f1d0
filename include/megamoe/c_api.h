/* C ABI over the C++ core, for ctypes (bench/compare_torch.py, the Python
 * package). Plain pointers and a cudaStream_t passed as void*; no torch.
 *
 * One workspace serves one MoE layer: it is sized once for
 * max_tokens_per_rank, holds the routing plan and the saved activations of
 * the last forward, and is reused by every later call. A backward uses the
 * state of the most recent forward on the same workspace.
 *
 * Every function returns 0 on success, else a non-zero megamoe StatusCode;
 * megamoe_last_error() then gives the message (thread-local). Nothing here
 * synchronises with the device, except megamoe_check_device_errors().
 */
#ifndef MEGAMOE_C_API_H_
#define MEGAMOE_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct megamoe_workspace megamoe_workspace;

/* precision: 0 bf16, 1 fp8, 2 fp8_bwd, 3 mxfp8. save_policy: 0 keep, 1 recompute.
 * backend: 0 cpu, 1 cuda, 2 auto. */
typedef struct megamoe_config {
  int64_t hidden, intermediate;
  int32_t num_experts, top_k, ep_rank, ep_size;
  int64_t max_tokens_per_rank;
  int32_t precision, save_policy, backend;
  int32_t device; /* CUDA device ordinal */
} megamoe_config;

int megamoe_workspace_create(const megamoe_config* config, megamoe_workspace** out);
void megamoe_workspace_destroy(megamoe_workspace* ws);
/* Device bytes the workspace holds (allocated at creation). */
size_t megamoe_workspace_bytes(const megamoe_workspace* ws);

/* Device pointers: x [T,H] bf16, topk_idx [T,k] int32, topk_weights [T,k] f32,
 * w13 [E/P,2I,H] bf16, w2 [E/P,H,I] bf16, y [T,H] bf16. */
int megamoe_forward(megamoe_workspace* ws, int64_t num_tokens, const void* x, const int32_t* topk_idx,
                    const float* topk_weights, const void* w13, const void* w2, void* y, void* stream);

/* dy [T,H] bf16 -> dx [T,H] bf16, d_topk_weights [T,k] f32, dw13/dw2 in
 * wgrad_dtype (0 bf16, 1 f32). Inputs must be those of the last forward. */
int megamoe_backward(megamoe_workspace* ws, int64_t num_tokens, const void* x, const int32_t* topk_idx,
                     const float* topk_weights, const void* w13, const void* w2, const void* dy, void* dx,
                     float* d_topk_weights, void* dw13, void* dw2, int32_t wgrad_dtype, void* stream);

/* ---- Tensor-descriptor entry points (the Python package uses these) ----
 * Any backend: CPU tensors run the CPU reference (bf16, or f64 = exact math),
 * CUDA tensors the CUDA layer. dtype: 0 bf16, 1 f32, 2 f64, 3 int32 (as
 * megamoe::DType); device: 0 cpu, 1 cuda. A config with backend 0 (cpu) or 2
 * (auto) creates a handle without device memory; backend 1 (cuda) or 2 with a
 * GPU present allocates the CUDA workspace. */
typedef struct megamoe_tensor {
  void* data;
  int32_t dtype, device, device_index, rank;
  int64_t shape[4];
} megamoe_tensor;

/* *epoch receives the number of this forward on the handle; pass it to the
 * backward. */
int megamoe_forward_t(megamoe_workspace* ws, const megamoe_tensor* x, const megamoe_tensor* topk_idx,
                      const megamoe_tensor* topk_weights, const megamoe_tensor* w13, const megamoe_tensor* w2,
                      const megamoe_tensor* y, void* stream, uint64_t* epoch);

/* Gradients for the forward numbered `epoch`. If a later forward has reused
 * the handle since (e.g. a framework replaying ops out of order), the forward
 * is first recomputed from the same inputs (into dx), so the result is always
 * the gradient of these inputs. */
int megamoe_backward_t(megamoe_workspace* ws, const megamoe_tensor* x, const megamoe_tensor* topk_idx,
                       const megamoe_tensor* topk_weights, const megamoe_tensor* w13, const megamoe_tensor* w2,
                       const megamoe_tensor* dy, const megamoe_tensor* dx, const megamoe_tensor* d_topk_weights,
                       const megamoe_tensor* dw13, const megamoe_tensor* dw2, void* stream, uint64_t epoch);

/* Synchronises `stream` and reports routing errors the device found (an expert
 * id out of range, a token routed twice to one expert) in the last call. */
int megamoe_check_device_errors(megamoe_workspace* ws, void* stream);

const char* megamoe_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* MEGAMOE_C_API_H_ */
