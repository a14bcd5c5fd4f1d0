#include "cuda/moe/cuda_layer.h"

#include <string>

#include "core/routing_plan.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/moe/device_plan.h"
#include "cuda/moe/layer_kernels.h"

namespace megamoe::cuda {

// Workspace carve-out, in this order, each region 256-byte aligned
// (C = pool capacity rows, T = max_tokens, E experts, k, H, I):
//   plan:        error_key u64[1] | chunk_counts i32[ceil(T/256), E] | expert_rows i32[E]
//                | expert_offset i32[E+1] | tile_expert i32[C/128] | route_row i32[T, k] | row_src i32[C]
//   x_pool       bf16 [C, H]     pooled x (forward; kept for dW13)
//   z_pool       bf16 [C, 2I]    GEMM1 output (saved with kKeep, recomputed with kRecompute)
//   a_pool       bf16 [C, I]     forward: silu(g) u; backward: topk_w * a (dW2 operand)
//   slots        bf16 [k, T, H]  forward: weighted expert outputs; backward: dx rows
//   dy_pool      bf16 [C, H]
//   dz_pool      bf16 [C, 2I]
//   dw_partial   f32  [C, I/128] per-tile partial sums of d topk_w
struct LayerWorkspace::Buffers {
  DevicePlanBuffers plan;
  void *x_pool, *z_pool, *a_pool, *slots, *dy_pool, *dz_pool;
  float* dw_partial;
  int64_t capacity;
};

namespace {

constexpr size_t kAlign = 256;

struct Carver {
  size_t offset = 0;
  char* base = nullptr;
  template <typename T>
  T* take(size_t count) {
    offset = (offset + kAlign - 1) / kAlign * kAlign;
    T* p = base == nullptr ? nullptr : reinterpret_cast<T*>(base + offset);
    offset += count * sizeof(T);
    return p;
  }
};

int64_t capacity_rows(const LayerShape& s) {
  return pool_capacity_rows(RoutingShape{1, s.num_experts, s.top_k, s.max_tokens});
}

// Lays out the buffers over `base` (nullptr: only measures). Returns the bytes.
size_t carve(const LayerShape& s, char* base, LayerWorkspace::Buffers* b) {
  const int64_t C = capacity_rows(s), T = s.max_tokens, H = s.hidden, I = s.intermediate;
  const int E = s.num_experts, k = s.top_k;
  const int64_t chunks = (T + kPlanChunk - 1) / kPlanChunk;
  Carver c{0, base};
  b->capacity = C;
  b->plan.error_key = c.take<unsigned long long>(1);
  b->plan.chunk_counts = c.take<int32_t>(static_cast<size_t>(chunks * E));
  b->plan.expert_rows = c.take<int32_t>(E);
  b->plan.expert_offset = c.take<int32_t>(E + 1);
  b->plan.tile_expert = c.take<int32_t>(static_cast<size_t>(C / kPoolRowAlign));
  b->plan.route_row = c.take<int32_t>(static_cast<size_t>(T * k));
  b->plan.row_src = c.take<int32_t>(static_cast<size_t>(C));
  b->x_pool = c.take<uint16_t>(static_cast<size_t>(C * H));
  b->z_pool = c.take<uint16_t>(static_cast<size_t>(C * 2 * I));
  b->a_pool = c.take<uint16_t>(static_cast<size_t>(C * I));
  b->slots = c.take<uint16_t>(static_cast<size_t>(k * T * H));
  b->dy_pool = c.take<uint16_t>(static_cast<size_t>(C * H));
  b->dz_pool = c.take<uint16_t>(static_cast<size_t>(C * 2 * I));
  b->dw_partial = c.take<float>(static_cast<size_t>(C * (I / kBlockN)));
  return (c.offset + kAlign - 1) / kAlign * kAlign;
}

Status cuda_error(const char* what, cudaError_t err) {
  return internal_error(std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace

size_t LayerWorkspace::bytes_for(const LayerShape& shape) {
  Buffers b;
  return carve(shape, nullptr, &b);
}

Status LayerWorkspace::create(const LayerShape& shape, int device, std::unique_ptr<LayerWorkspace>* out) {
  cudaDeviceProp prop{};
  cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) return unavailable(std::string("backend cuda: device ") + std::to_string(device) + ": " +
                                             cudaGetErrorString(err));
  if (prop.major != 9 || prop.minor != 0)
    return unimplemented("backend cuda: the kernels need a Hopper GPU (sm_90), device " + std::to_string(device) +
                         " is " + prop.name + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ")");
  if (shape.top_k > kMaxTopK)
    return invalid_argument("top_k = " + std::to_string(shape.top_k) + " exceeds the CUDA backend's limit of " +
                            std::to_string(kMaxTopK));
  std::unique_ptr<LayerWorkspace> ws(new LayerWorkspace());
  ws->shape_ = shape;
  ws->device_ = device;
  ws->num_sms_ = prop.multiProcessorCount;
  ws->buf_ = std::make_unique<Buffers>();
  ws->bytes_ = bytes_for(shape);
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device);
  err = cudaMalloc(&ws->base_, ws->bytes_);
  cudaSetDevice(prev);
  if (err != cudaSuccess)
    return Status(StatusCode::kCapacity, "backend cuda: cannot allocate the " + std::to_string(ws->bytes_ >> 20) +
                                             " MiB workspace: " + cudaGetErrorString(err));
  carve(shape, static_cast<char*>(ws->base_), ws->buf_.get());
  *out = std::move(ws);
  return Status::Ok();
}

LayerWorkspace::~LayerWorkspace() {
  if (base_ != nullptr) cudaFree(base_);
}

namespace {

DevicePlan device_plan(const DevicePlanBuffers& b, int64_t T, const LayerShape& s) {
  DevicePlan p;
  p.pool_rows = b.expert_offset + s.num_experts;
  p.tile_expert = b.tile_expert;
  p.expert_offset = b.expert_offset;
  p.expert_rows = b.expert_rows;
  p.row_src = b.row_src;
  p.num_tokens = static_cast<int>(T);
  p.top_k = s.top_k;
  p.num_experts = s.num_experts;
  return p;
}

// An M-grouped GEMM over the pool: A = pool [C, k], B = stacked expert weights [b_rows, b_cols].
GroupedGemmArgs pool_gemm(GemmMode mode, const DevicePlan& plan, const LayerShape& s, int64_t capacity,
                          const void* a, int64_t k, const void* b, int64_t b_rows, int64_t b_cols, int64_t n) {
  GroupedGemmArgs g;
  g.mode = mode;
  g.plan = plan;
  g.n = n;
  g.k = k;
  g.intermediate = s.intermediate;
  g.a = a, g.a_rows = capacity, g.a_cols = k;
  g.b = b, g.b_rows = b_rows, g.b_cols = b_cols;
  return g;
}

}  // namespace

Status LayerWorkspace::forward(int64_t T, const LayerInputs& in, void* y, SavePolicy policy, cudaStream_t stream) {
  if (T > shape_.max_tokens)
    return capacity_error("num_tokens = " + std::to_string(T) + " exceeds the workspace's max_tokens_per_rank = " +
                          std::to_string(shape_.max_tokens));
  ++epoch_;
  const LayerShape& s = shape_;
  const Buffers& b = *buf_;
  const int64_t H = s.hidden, I = s.intermediate, C = b.capacity;
  MEGAMOE_RETURN_IF_ERROR(build_device_plan(in.topk_idx, T, s.top_k, s.num_experts, b.plan, stream));
  const DevicePlan plan = device_plan(b.plan, T, s);
  MEGAMOE_RETURN_IF_ERROR(gather_rows(in.x, H, b.plan.row_src, s.top_k, plan.pool_rows, C, b.x_pool, stream));

  const int64_t E = s.num_experts;
  GroupedGemmArgs g1 = pool_gemm(GemmMode::kGateUp, plan, s, C, b.x_pool, H, in.w13, E * 2 * I, H, I);
  g1.out0 = policy == SavePolicy::kKeep ? b.z_pool : nullptr;
  g1.out1 = b.a_pool;
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g1, num_sms_, stream));

  GroupedGemmArgs g2 = pool_gemm(GemmMode::kDown, plan, s, C, b.a_pool, I, in.w2, E * H, I, H);
  g2.topk_weights = in.topk_weights;
  g2.out0 = b.slots;
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g2, num_sms_, stream));

  return combine_slots(b.slots, in.topk_idx, T, s.top_k, s.num_experts, H, b.plan.error_key, y, stream);
}

Status LayerWorkspace::backward(int64_t T, const LayerInputs& in, const void* dy, const LayerGrads& grads,
                                SavePolicy policy, cudaStream_t stream) {
  const LayerShape& s = shape_;
  const Buffers& b = *buf_;
  const int64_t H = s.hidden, I = s.intermediate, C = b.capacity, E = s.num_experts;
  const DevicePlan plan = device_plan(b.plan, T, s);

  if (policy == SavePolicy::kRecompute) {  // x_pool was gathered by the forward; z was not kept
    GroupedGemmArgs g1 = pool_gemm(GemmMode::kGateUp, plan, s, C, b.x_pool, H, in.w13, E * 2 * I, H, I);
    g1.out0 = b.z_pool;
    MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g1, num_sms_, stream));
  }
  MEGAMOE_RETURN_IF_ERROR(gather_rows(dy, H, b.plan.row_src, s.top_k, plan.pool_rows, C, b.dy_pool, stream));

  // ga = dy @ w2[e]; fused: d topk_w partials, dz, topk_w * a.
  GroupedGemmArgs gd = pool_gemm(GemmMode::kDownGrad, plan, s, C, b.dy_pool, H, in.w2, E * H, I, I);
  gd.topk_weights = in.topk_weights;
  gd.z_pool = b.z_pool;
  gd.out0 = b.dz_pool;
  gd.out1 = b.a_pool;
  gd.dw_partial = b.dw_partial;
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(gd, num_sms_, stream));
  MEGAMOE_RETURN_IF_ERROR(reduce_route_partials(b.dw_partial, static_cast<int>(I / kBlockN), b.plan.route_row,
                                                T * s.top_k, b.plan.error_key, grads.d_topk_weights, stream));

  // dx slots = dz @ w13[e], then the fixed-order sum.
  GroupedGemmArgs gx = pool_gemm(GemmMode::kGateUpGrad, plan, s, C, b.dz_pool, 2 * I, in.w13, E * 2 * I, H, H);
  gx.out0 = b.slots;
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(gx, num_sms_, stream));
  MEGAMOE_RETURN_IF_ERROR(
      combine_slots(b.slots, in.topk_idx, T, s.top_k, s.num_experts, H, b.plan.error_key, grads.dx, stream));

  // dW2[e] = dy^T (w a), dW13[e] = dz^T x over each expert's pool rows.
  GroupedGemmArgs w2g;
  w2g.mode = GemmMode::kWeightGrad;
  w2g.plan = plan;
  w2g.m = H;
  w2g.n = I;
  w2g.a = b.dy_pool, w2g.a_rows = C, w2g.a_cols = H;
  w2g.b = b.a_pool, w2g.b_rows = C, w2g.b_cols = I;
  w2g.out0 = grads.dw2;
  w2g.out_f32 = grads.wgrad_f32;
  w2g.accumulate = grads.accumulate;
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(w2g, num_sms_, stream));
  GroupedGemmArgs w13g = w2g;
  w13g.m = 2 * I;
  w13g.n = H;
  w13g.a = b.dz_pool, w13g.a_rows = C, w13g.a_cols = 2 * I;
  w13g.b = b.x_pool, w13g.b_rows = C, w13g.b_cols = H;
  w13g.out0 = grads.dw13;
  return launch_grouped_gemm(w13g, num_sms_, stream);
}

Status LayerWorkspace::check_device_errors(cudaStream_t stream, int top_k) const {
  cudaError_t err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return cuda_error("backend cuda: stream synchronize", err);
  unsigned long long key = 0;
  err = cudaMemcpy(&key, buf_->plan.error_key, sizeof key, cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return cuda_error("backend cuda: read error key", err);
  if (key == kNoPlanError) return Status::Ok();
  const unsigned long long route = key >> 2;
  const std::string where = "topk_idx[" + std::to_string(route / top_k) + "," + std::to_string(route % top_k) + "]";
  if ((key & 3) == kPlanErrorOutOfRange)
    return invalid_argument(where + " is out of range [-1, num_experts = " + std::to_string(shape_.num_experts) +
                            ") (found on the device; outputs were set to NaN)");
  return invalid_argument("token " + std::to_string(route / top_k) + " is routed twice to one expert (" + where +
                          " repeats an earlier slot; found on the device; outputs were set to NaN)");
}

}  // namespace megamoe::cuda
