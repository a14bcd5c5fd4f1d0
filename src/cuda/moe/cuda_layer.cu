#include "cuda/moe/cuda_layer.h"

#include <string>

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/moe/device_plan.h"
#include "cuda/moe/layer_kernels.h"

namespace megamoe::cuda {
namespace {

template <typename T>
T* at(void* base, const Region& r) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + r.offset);
}

// The plan region (saved layout) of a call: in the saved buffer, or in scratch.
struct PlanView {
  DevicePlanBuffers plan;
  void* z_pool;
};

PlanView plan_view(void* base, const SavedLayout& s, int32_t* chunk_counts) {
  PlanView v;
  v.plan.error_key = at<unsigned long long>(base, s.error_key);
  v.plan.chunk_counts = chunk_counts;
  v.plan.expert_rows = at<int32_t>(base, s.expert_rows);
  v.plan.expert_offset = at<int32_t>(base, s.expert_offset);
  v.plan.tile_expert = at<int32_t>(base, s.tile_expert);
  v.plan.route_row = at<int32_t>(base, s.route_row);
  v.plan.row_src = at<int32_t>(base, s.row_src);
  v.z_pool = at<void>(base, s.z_pool);
  return v;
}

struct Carved {
  PlanView pv;
  void *xdy_pool, *a_pool, *slots, *dz_pool;
  float* dw_partial;
  int64_t capacity;
};

Status carve(const LayerCall& call, const LayerBuffers& b, Carved* c) {
  ScratchLayout sl;
  MEGAMOE_RETURN_IF_ERROR(scratch_layout(call.dims, b.saved == nullptr, &sl));
  MEGAMOE_RETURN_IF_ERROR(pool_capacity(call.dims, &c->capacity));
  auto* chunk_counts = at<int32_t>(b.scratch, sl.chunk_counts);
  if (b.saved != nullptr) {
    SavedLayout s;
    MEGAMOE_RETURN_IF_ERROR(saved_layout(call.dims, &s));
    c->pv = plan_view(b.saved, s, chunk_counts);
  } else {
    c->pv = plan_view(static_cast<char*>(b.scratch) + sl.plan_offset, sl.plan, chunk_counts);
  }
  c->xdy_pool = at<void>(b.scratch, sl.xdy_pool);
  c->a_pool = at<void>(b.scratch, sl.a_pool);
  c->slots = at<void>(b.scratch, sl.slots);
  c->dz_pool = at<void>(b.scratch, sl.dz_pool);
  c->dw_partial = at<float>(b.scratch, sl.dw_partial);
  return Status::Ok();
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

DevicePlan device_plan(const DevicePlanBuffers& b, const LayerDims& d) {
  DevicePlan p;
  p.pool_rows = b.expert_offset + d.num_experts;
  p.tile_expert = b.tile_expert;
  p.expert_offset = b.expert_offset;
  p.expert_rows = b.expert_rows;
  p.row_src = b.row_src;
  p.num_tokens = static_cast<int>(d.tokens);
  p.top_k = d.top_k;
  p.num_experts = d.num_experts;
  return p;
}

// An M-grouped GEMM over the pool: A = pool [C, k], B = stacked expert weights [b_rows, b_cols].
GroupedGemmArgs pool_gemm(GemmMode mode, const LayerCall& call, const DevicePlan& plan, int64_t capacity,
                          const void* a, int64_t k, const void* b, int64_t b_rows, int64_t b_cols, int64_t n) {
  GroupedGemmArgs g;
  g.mode = mode;
  g.plan = plan;
  g.n = n;
  g.k = k;
  g.intermediate = call.dims.intermediate;
  g.a = a, g.a_rows = capacity, g.a_cols = k;
  g.b = b, g.b_rows = b_rows, g.b_cols = b_cols;
  g.errors = call.errors;
  return g;
}

// dW[e] = A_pool^T @ B_pool over each expert's rows.
GroupedGemmArgs weight_grad(const LayerCall& call, const DevicePlan& plan, int64_t capacity, const void* a,
                            int64_t m, const void* b, int64_t n, void* out, const LayerGrads& grads) {
  GroupedGemmArgs g;
  g.mode = GemmMode::kWeightGrad;
  g.plan = plan;
  g.m = m;
  g.n = n;
  g.a = a, g.a_rows = capacity, g.a_cols = m;
  g.b = b, g.b_rows = capacity, g.b_cols = n;
  g.out0 = out;
  g.out_f32 = grads.wgrad_f32;
  g.accumulate = grads.accumulate;
  g.errors = call.errors;
  return g;
}

// The kernels are sm_90a: say so once per device instead of failing at launch.
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

}  // namespace

Status prepare_layer_call(const LayerDims& dims, int device, cudaStream_t stream, const LayerBuffers& buffers,
                          LayerCall* call) {
  if (dims.top_k > kMaxTopK)
    return invalid_argument("top_k = " + std::to_string(dims.top_k) + " exceeds the CUDA backend's limit of " +
                            std::to_string(kMaxTopK));
  ScratchLayout sl;
  MEGAMOE_RETURN_IF_ERROR(scratch_layout(dims, buffers.saved == nullptr, &sl));
  if (buffers.scratch == nullptr || buffers.scratch_bytes < sl.bytes)
    return capacity_error("scratch: " + std::to_string(buffers.scratch_bytes) + " bytes given, this call (" +
                          std::to_string(dims.tokens) + " tokens) needs " + std::to_string(sl.bytes) +
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
  call->dims = dims;
  call->device = device;
  call->stream = stream;
  const uint64_t timeout = call->errors.timeout_ns;
  MEGAMOE_RETURN_IF_ERROR(device_error_sink(device, &call->errors));
  call->errors.timeout_ns = timeout;
  return Status::Ok();
}

Status layer_forward(const LayerCall& call, const LayerInputs& in, void* y, const LayerBuffers& buffers) {
  const LayerDims& d = call.dims;
  Carved c;
  MEGAMOE_RETURN_IF_ERROR(carve(call, buffers, &c));
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, C = c.capacity, T = d.tokens;
  const int sms = sm_count(call.device);
  MEGAMOE_RETURN_IF_ERROR(build_device_plan(in.topk_idx, T, d.top_k, d.num_experts, c.pv.plan, call.stream));
  const DevicePlan plan = device_plan(c.pv.plan, d);
  MEGAMOE_RETURN_IF_ERROR(
      gather_rows(in.x, H, c.pv.plan.row_src, d.top_k, plan.pool_rows, C, c.xdy_pool, call.stream));

  GroupedGemmArgs g1 = pool_gemm(GemmMode::kGateUp, call, plan, C, c.xdy_pool, H, in.w13, E * 2 * I, H, I);
  g1.out0 = buffers.saved != nullptr ? c.pv.z_pool : nullptr;  // z is kept only for a backward
  g1.out1 = c.a_pool;
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g1, sms, call.stream));

  GroupedGemmArgs g2 = pool_gemm(GemmMode::kDown, call, plan, C, c.a_pool, I, in.w2, E * H, I, H);
  g2.topk_weights = in.topk_weights;
  g2.out0 = c.slots;
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g2, sms, call.stream));

  return combine_slots(c.slots, in.topk_idx, T, d.top_k, d.num_experts, H, c.pv.plan.error_key, call.errors, y,
                       call.stream);
}

Status layer_backward(const LayerCall& call, const LayerInputs& in, const void* dy, const LayerGrads& grads,
                      const LayerBuffers& buffers) {
  const LayerDims& d = call.dims;
  Carved c;
  MEGAMOE_RETURN_IF_ERROR(carve(call, buffers, &c));
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, C = c.capacity, T = d.tokens;
  const int sms = sm_count(call.device);
  const DevicePlan plan = device_plan(c.pv.plan, d);

  if (buffers.saved == nullptr) {  // nothing saved: rebuild the plan and z in scratch
    MEGAMOE_RETURN_IF_ERROR(build_device_plan(in.topk_idx, T, d.top_k, d.num_experts, c.pv.plan, call.stream));
    MEGAMOE_RETURN_IF_ERROR(
        gather_rows(in.x, H, c.pv.plan.row_src, d.top_k, plan.pool_rows, C, c.xdy_pool, call.stream));
    GroupedGemmArgs g1 = pool_gemm(GemmMode::kGateUp, call, plan, C, c.xdy_pool, H, in.w13, E * 2 * I, H, I);
    g1.out0 = c.pv.z_pool;
    MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g1, sms, call.stream));
  }
  // xdy_pool now takes dy (x is gathered again for dW13 at the end).
  MEGAMOE_RETURN_IF_ERROR(gather_rows(dy, H, c.pv.plan.row_src, d.top_k, plan.pool_rows, C, c.xdy_pool, call.stream));

  // ga = dy @ w2[e]; fused: d topk_w partials, dz, topk_w * a.
  GroupedGemmArgs gd = pool_gemm(GemmMode::kDownGrad, call, plan, C, c.xdy_pool, H, in.w2, E * H, I, I);
  gd.topk_weights = in.topk_weights;
  gd.z_pool = c.pv.z_pool;
  gd.out0 = c.dz_pool;
  gd.out1 = c.a_pool;
  gd.dw_partial = c.dw_partial;
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(gd, sms, call.stream));
  MEGAMOE_RETURN_IF_ERROR(reduce_route_partials(c.dw_partial, static_cast<int>(I / kBlockN), c.pv.plan.route_row,
                                                T * d.top_k, c.pv.plan.error_key, grads.d_topk_weights, call.stream));

  // dx slots = dz @ w13[e], then the fixed-order sum.
  GroupedGemmArgs gx = pool_gemm(GemmMode::kGateUpGrad, call, plan, C, c.dz_pool, 2 * I, in.w13, E * 2 * I, H, H);
  gx.out0 = c.slots;
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(gx, sms, call.stream));
  MEGAMOE_RETURN_IF_ERROR(combine_slots(c.slots, in.topk_idx, T, d.top_k, d.num_experts, H, c.pv.plan.error_key,
                                        call.errors, grads.dx, call.stream));

  // dW2[e] = dy^T (w a); then x back into the pool for dW13[e] = dz^T x.
  MEGAMOE_RETURN_IF_ERROR(
      launch_grouped_gemm(weight_grad(call, plan, C, c.xdy_pool, H, c.a_pool, I, grads.dw2, grads), sms, call.stream));
  MEGAMOE_RETURN_IF_ERROR(
      gather_rows(in.x, H, c.pv.plan.row_src, d.top_k, plan.pool_rows, C, c.xdy_pool, call.stream));
  return launch_grouped_gemm(weight_grad(call, plan, C, c.dz_pool, 2 * I, c.xdy_pool, H, grads.dw13, grads), sms,
                             call.stream);
}

}  // namespace megamoe::cuda
