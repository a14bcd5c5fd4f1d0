#include "cuda/moe/cuda_layer.h"

#include <string>

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/moe/device_plan.h"
#include "cuda/moe/fp8_parts.h"
#include "cuda/moe/layer_kernels.h"
#include "cuda/moe/layer_parts.h"

namespace megamoe::cuda {
namespace {

using detail::Carved;
using detail::carve;
using detail::carve_fp8;
using detail::device_plan;
using detail::Fp8Carved;
using detail::fp8_data_grad_gemms;
using detail::fp8_down;
using detail::fp8_gate_up;
using detail::fp8_weight_grad;
using detail::pool_gemm;
using detail::sm_count;
using detail::weight_grad;

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
                          LayerCall* call, bool slots_at_sources) {
  if (dims.top_k > kMaxTopK)
    return invalid_argument("top_k = " + std::to_string(dims.top_k) + " exceeds the CUDA backend's limit of " +
                            std::to_string(kMaxTopK));
  ScratchLayout sl;
  MEGAMOE_RETURN_IF_ERROR(scratch_layout(dims, buffers.saved == nullptr, &sl));
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

Status layer_forward(const LayerCall& call, const LayerInputs& in, void* y, const LayerBuffers& buffers) {
  if (call.slots_at_sources) return invalid_argument("layer_forward: an expert-parallel owner's call (no slots region)");
  const LayerDims& d = call.dims;
  Carved c;
  MEGAMOE_RETURN_IF_ERROR(carve(call, buffers, &c));
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, C = c.capacity, T = d.tokens;
  const int sms = sm_count(call.device);
  MEGAMOE_RETURN_IF_ERROR(build_device_plan(in.topk_idx, T, d.top_k, d.num_experts, c.pv.plan, call.stream));
  const DevicePlan plan = device_plan(c.pv.plan, d);
  MEGAMOE_RETURN_IF_ERROR(
      gather_rows(in.x, H, c.pv.plan.row_src, d.top_k, plan.pool_rows, C, c.xdy_pool, call.stream));
  void* z_keep = buffers.saved != nullptr ? c.pv.z_pool : nullptr;  // z is kept only for a backward

  if (d.precision == Precision::kFP8) {
    Fp8Carved f;
    MEGAMOE_RETURN_IF_ERROR(carve_fp8(call, buffers, &f));
    MEGAMOE_RETURN_IF_ERROR(fp8_gate_up(call, plan, c, f, in.w13, z_keep, c.a_pool, sms));
    MEGAMOE_RETURN_IF_ERROR(fp8_down(call, plan, c, f, in.w2, in.topk_weights, sms));
  } else {  // bf16 (and fp8_bwd's forward)
    GroupedGemmArgs g1 = pool_gemm(GemmMode::kGateUp, call, plan, C, c.xdy_pool, H, in.w13, E * 2 * I, H, I);
    g1.out0 = z_keep;
    g1.out1 = c.a_pool;
    MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g1, sms, call.stream));

    GroupedGemmArgs g2 = pool_gemm(GemmMode::kDown, call, plan, C, c.a_pool, I, in.w2, E * H, I, H);
    g2.topk_weights = in.topk_weights;
    g2.out0 = c.slots;
    MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g2, sms, call.stream));
  }

  return combine_slots(c.slots, in.topk_idx, T, d.top_k, d.num_experts, H, c.pv.plan.error_key, call.errors, y,
                       call.stream);
}

Status layer_backward(const LayerCall& call, const LayerInputs& in, const void* dy, const LayerGrads& grads,
                      const LayerBuffers& buffers) {
  if (call.slots_at_sources) return invalid_argument("layer_backward: an expert-parallel owner's call (no slots region)");
  const LayerDims& d = call.dims;
  Carved c;
  MEGAMOE_RETURN_IF_ERROR(carve(call, buffers, &c));
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, C = c.capacity, T = d.tokens;
  const int sms = sm_count(call.device);
  const DevicePlan plan = device_plan(c.pv.plan, d);
  const bool fp8 = d.precision == Precision::kFP8 || d.precision == Precision::kFP8Bwd;  // the backward's GEMMs
  Fp8Carved f{};
  if (fp8) MEGAMOE_RETURN_IF_ERROR(carve_fp8(call, buffers, &f));

  if (buffers.saved == nullptr) {  // nothing saved: rebuild the plan and z in scratch, as the forward made it
    MEGAMOE_RETURN_IF_ERROR(build_device_plan(in.topk_idx, T, d.top_k, d.num_experts, c.pv.plan, call.stream));
    MEGAMOE_RETURN_IF_ERROR(
        gather_rows(in.x, H, c.pv.plan.row_src, d.top_k, plan.pool_rows, C, c.xdy_pool, call.stream));
    if (d.precision == Precision::kFP8) {
      MEGAMOE_RETURN_IF_ERROR(fp8_gate_up(call, plan, c, f, in.w13, c.pv.z_pool, nullptr, sms));
    } else {
      GroupedGemmArgs g1 = pool_gemm(GemmMode::kGateUp, call, plan, C, c.xdy_pool, H, in.w13, E * 2 * I, H, I);
      g1.out0 = c.pv.z_pool;
      MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(g1, sms, call.stream));
    }
  }
  // xdy_pool now takes dy (x is gathered again for dW13 at the end).
  MEGAMOE_RETURN_IF_ERROR(gather_rows(dy, H, c.pv.plan.row_src, d.top_k, plan.pool_rows, C, c.xdy_pool, call.stream));

  // ga = dy @ w2[e] (fused: d topk_w partials, dz, topk_w * a), d topk_w, then the dx slots = dz @ w13[e].
  if (fp8) {
    MEGAMOE_RETURN_IF_ERROR(
        fp8_data_grad_gemms(call, plan, c, f, in.w2, in.w13, in.topk_weights, grads.d_topk_weights, sms));
  } else {
    MEGAMOE_RETURN_IF_ERROR(
        detail::data_grad_gemms(call, plan, c, in.w2, in.w13, in.topk_weights, grads.d_topk_weights, sms));
  }
  // dx: the fixed-order sum of its slots.
  MEGAMOE_RETURN_IF_ERROR(combine_slots(c.slots, in.topk_idx, T, d.top_k, d.num_experts, H, c.pv.plan.error_key,
                                        call.errors, grads.dx, call.stream));

  // dW2[e] = dy^T (w a); then x back into the pool for dW13[e] = dz^T x.
  if (fp8) {
    MEGAMOE_RETURN_IF_ERROR(fp8_weight_grad(call, plan, C, c.xdy_pool, H, f.dy_t, f.dy_ts, c.a_pool, I, f.wa_t,
                                            f.wa_ts, grads.dw2, grads, sms));
  } else {
    MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(weight_grad(call, plan, C, c.xdy_pool, H, c.a_pool, I, grads.dw2, grads),
                                                sms, call.stream));
  }
  MEGAMOE_RETURN_IF_ERROR(
      gather_rows(in.x, H, c.pv.plan.row_src, d.top_k, plan.pool_rows, C, c.xdy_pool, call.stream));
  if (fp8)
    return fp8_weight_grad(call, plan, C, c.dz_pool, 2 * I, f.dz_t, f.dz_ts, c.xdy_pool, H, f.x_t, f.x_ts, grads.dw13,
                           grads, sms);
  return launch_grouped_gemm(weight_grad(call, plan, C, c.dz_pool, 2 * I, c.xdy_pool, H, grads.dw13, grads), sms,
                             call.stream);
}

}  // namespace megamoe::cuda
