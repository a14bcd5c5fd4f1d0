/* C ABI over the C++ core, for ctypes (the Python package). Plain pointers
 * and a cudaStream_t passed as void*; no torch, no handles, no state kept
 * between calls: the caller owns every buffer.
 *
 * CUDA tensors run the CUDA layer on two caller-provided device buffers
 * (sizes from megamoe_buffer_sizes, layouts in src/core/layer_buffers.h):
 *   scratch  needed during the call only; share one per device and stream.
 *   saved    written by a forward, read by its backward (the routing plan
 *            and z, save policy keep); bytes 0 = nothing saved (recompute
 *            policy, or no backward follows) — the backward then recomputes.
 * CPU tensors run the CPU reference (bf16, or f64 = exact math); buffers are
 * ignored and the backward recomputes its forward.
 *
 * Every function returns 0 on success, else a non-zero megamoe StatusCode;
 * megamoe_last_error() then gives the message (thread-local). Nothing here
 * synchronises with the device except megamoe_check() and calls with
 * config.validate = 1. An error a kernel found (a bad expert id, a timed-out
 * wait) is returned by the first call on that device that starts after the
 * kernel ran, or by megamoe_check().
 */
#ifndef MEGAMOE_C_API_H_
#define MEGAMOE_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* precision: 0 bf16, 1 fp8, 2 fp8_bwd, 3 mxfp8. save_policy: 0 keep, 1 recompute. */
typedef struct megamoe_config {
  int64_t hidden, intermediate;
  int32_t num_experts, top_k, ep_rank, ep_size;
  int32_t precision, save_policy;
  int32_t validate;          /* 1: synchronise and report device errors before returning */
  int32_t accumulate_wgrad;  /* 1: dw13/dw2 are f32 and the gradients are added to them */
  int64_t device_timeout_ms; /* bound of device spin-waits; 0 = default (10 s) */
  int32_t fp8_scale;         /* FP8 block scales (fp8, fp8_bwd): 0 fp32 (amax / 448), 1 powers of two */
  int32_t cuda_paths;        /* the other of two equal-result paths (megamoe::CudaPaths), 0 = the defaults:
                                bit 0 no side jobs, bit 1 no rows-first tiles, bit 2 kDown into slots */
} megamoe_config;

/* dtype: 0 bf16, 1 f32, 2 f64, 3 int32 (as megamoe::DType); device: 0 cpu, 1 cuda. */
typedef struct megamoe_tensor {
  void* data;
  int32_t dtype, device, device_index, rank;
  int64_t shape[4];
} megamoe_tensor;

typedef struct megamoe_buffer {
  void* data; /* device memory, 256-byte aligned */
  uint64_t bytes;
} megamoe_buffer;

/* A layer's FP8 weights (precision fp8 / fp8_bwd on CUDA; null otherwise):
 * its expert weights in e4m3, both orientations, with block scales (layout
 * Fp8WeightLayout in src/core/layer_buffers.h), kept by the caller across
 * calls. ready = 0: the call quantises w13 and w2 into it first; ready = 1:
 * the call reads it as it is (the caller vouches that w13 and w2 have not
 * changed since it was filled). */
typedef struct megamoe_fp8_weights {
  void* data; /* device memory, 256-byte aligned */
  uint64_t bytes;
  int32_t ready;
} megamoe_fp8_weights;

/* Buffer sizes for a call of num_tokens tokens; will_backward = 0 for a
 * forward that no backward follows (then *saved_bytes = 0). */
int megamoe_buffer_sizes(const megamoe_config* config, int64_t num_tokens, int32_t will_backward,
                         uint64_t* scratch_bytes, uint64_t* saved_bytes);

/* Bytes of a layer's FP8 weight buffer (0 unless the precision is fp8 or fp8_bwd).
 * With ep_size > 1: one rank's, for its E / P experts (as megamoe_fill_fp8_weights). */
int megamoe_fp8_weight_bytes(const megamoe_config* config, uint64_t* bytes);

/* Fills fp8_weights (its `ready` is ignored) from w13 [E,2I,H] and w2 [E,H,I]
 * (with ep_size > 1, this rank's [E/P,2I,H] and [E/P,H,I]), bf16 CUDA
 * tensors, as a call with ready = 0 does first; async on stream. */
int megamoe_fill_fp8_weights(const megamoe_config* config, const megamoe_tensor* w13, const megamoe_tensor* w2,
                             const megamoe_fp8_weights* fp8_weights, void* stream);

/* x [T,H], topk_idx [T,k] int32, topk_weights [T,k] f32 (f64 exact), w13 [E/P,2I,H], w2 [E/P,H,I], y [T,H]. */
int megamoe_forward(const megamoe_config* config, const megamoe_tensor* x, const megamoe_tensor* topk_idx,
                    const megamoe_tensor* topk_weights, const megamoe_tensor* w13, const megamoe_tensor* w2,
                    const megamoe_tensor* y, const megamoe_buffer* saved, const megamoe_buffer* scratch,
                    const megamoe_fp8_weights* fp8_weights, void* stream);

/* Gradients of <y, dy>; `saved` must be the buffer its forward wrote (or bytes 0). */
int megamoe_backward(const megamoe_config* config, const megamoe_tensor* x, const megamoe_tensor* topk_idx,
                     const megamoe_tensor* topk_weights, const megamoe_tensor* w13, const megamoe_tensor* w2,
                     const megamoe_tensor* dy, const megamoe_tensor* dx, const megamoe_tensor* d_topk_weights,
                     const megamoe_tensor* dw13, const megamoe_tensor* dw2, const megamoe_buffer* saved,
                     const megamoe_buffer* scratch, const megamoe_fp8_weights* fp8_weights, void* stream);

/* Expert parallelism (src/cuda/layer/ep_layer.h), CUDA only, config.ep_size
 * ranks of config.ep_rank: each rank calls with its own tokens and its E/P
 * experts' w13 [E/P,2I,H], w2 [E/P,H,I]; the calls of all ranks meet through
 * the group's symmetric buffer. The call waits for the other ranks on the
 * device (bounded by device_timeout_ms; a rank that never comes is named in
 * the error and the outputs are NaN), never on the host. */
typedef struct megamoe_ep_group {
  void* local;               /* this rank's symmetric buffer */
  void* const* peers;        /* device array [ep_size]: every rank's buffer as this device sees it */
  uint64_t bytes;            /* its size, the same on every rank (>= symmetric_bytes of megamoe_ep_sizes) */
  int64_t max_tokens;        /* the most tokens any rank brings to one call; the same on every rank */
  megamoe_buffer ep_scratch; /* this rank's own: zeroed once, then kept for the symmetric buffer's life */
  uint32_t epoch;            /* above every epoch used on the buffer before, the same on every rank:
                                a forward takes epoch, a backward epoch and epoch + 1 */
} megamoe_ep_group;

/* Sizes: the symmetric buffer and the EP scratch (per group and device), and
 * a call's scratch and saved buffers (will_backward = 0: saved 0). */
int megamoe_ep_sizes(const megamoe_config* config, int64_t max_tokens, int32_t will_backward,
                     uint64_t* symmetric_bytes, uint64_t* ep_scratch_bytes, uint64_t* scratch_bytes,
                     uint64_t* saved_bytes);
/* As megamoe_forward / megamoe_backward, over the group (save policy keep).
 * FP8 (fp8 / fp8_bwd): the owner's GEMMs run in e4m3 with this rank's FP8
 * weights (megamoe_fp8_weight_bytes with ep_size > 1), bitwise the one-GPU
 * FP8 layer on the whole batch; fp8's forward sends its rows in e4m3 with
 * their scales, the backward's rows are bf16. */
int megamoe_ep_forward(const megamoe_config* config, const megamoe_ep_group* group, const megamoe_tensor* x,
                       const megamoe_tensor* topk_idx, const megamoe_tensor* topk_weights, const megamoe_tensor* w13,
                       const megamoe_tensor* w2, const megamoe_tensor* y, const megamoe_buffer* saved,
                       const megamoe_buffer* scratch, const megamoe_fp8_weights* fp8_weights, void* stream);
int megamoe_ep_backward(const megamoe_config* config, const megamoe_ep_group* group, const megamoe_tensor* x,
                        const megamoe_tensor* topk_idx, const megamoe_tensor* topk_weights,
                        const megamoe_tensor* w13, const megamoe_tensor* w2, const megamoe_tensor* dy,
                        const megamoe_tensor* dx, const megamoe_tensor* d_topk_weights, const megamoe_tensor* dw13,
                        const megamoe_tensor* dw2, const megamoe_buffer* saved, const megamoe_buffer* scratch,
                        const megamoe_fp8_weights* fp8_weights, void* stream);

/* Model preset `index` (include/megamoe/presets.h): 0 and *out filled for
   index in [0, count), else an error; *count (when not null) gets the count. */
typedef struct megamoe_preset_info {
  const char* name; /* static storage */
  int64_t hidden, intermediate;
  int32_t num_experts, top_k;
  int32_t attention_heads, kv_heads, head_dim;
} megamoe_preset_info;
int megamoe_preset(int32_t index, megamoe_preset_info* out, int32_t* count);

/* Synchronises `stream` and reports (then clears) an error the kernels found on `device`. */
int megamoe_check(int32_t device, void* stream);

/* Peer-memory self-check for expert parallelism, on memory any provider
 * mapped (PyTorch symmetric memory, say): this rank's buffer `local`, the
 * device array `peers` [world] of every rank's buffer as this rank's device
 * sees it, and their size `bytes` (the same on every rank). The buffers are
 * overwritten. phase 0: write this rank's payload (source, destination,
 * index) into its region of every rank's buffer, async on `stream`. phase 1,
 * once every rank's phase 0 has completed (the caller's barrier): count the
 * words of this rank's buffer that do not hold what their writer put there
 * into *wrong; synchronises `stream`. world in [1, 8]. */
int megamoe_peer_check(int32_t phase, int32_t rank, int32_t world, void* local, void* const* peers, uint64_t bytes,
                       void* stream, int64_t* wrong);

/* 1 when this build has the CUDA layer and sees a GPU; *why (static storage) says why not. */
int megamoe_cuda_available(const char** why);

const char* megamoe_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* MEGAMOE_C_API_H_ */
