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
using detail::check_fp8_weights;
using detail::device_plan;
using detail::Fp8Carved;
using detail::fp8_backward;
using detail::fp8_data_grad_gemms;
using detail::fp8_down;
using detail::fp8_down_weight_grad;
using detail::fp8_forward;
using detail::fp8_gate_up;
using detail::fp8_gate_up_weight_grad;
using detail::pool_gemm;
using detail::refresh_fp8_weights;
using detail::sm_count;
using detail::weight_grad_gemm;

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

// The bf16 GEMMs gather x's and dy's token rows themselves
// (GroupedGemmArgs::gather) instead of reading pools made by gather_rows:
// an experiment, only when built with -DMEGAMOE_GATHER_ROWS=ON (1.5-3x
// slower in session 33; docs/fp8-plan.md "Next" item 1). The pools stay
// allocated either way.
#ifdef MEGAMOE_GATHER_ROWS
constexpr bool kGatherRows = true;
#else
constexpr bool kGatherRows = false;
#endif
bool gathers_rows(const LayerDims& d) { return kGatherRows && d.tokens > 0; }

// Token rows [T, width] into the expert-major pool, each read once
// (scatter_rows: the pool gather_rows would make, with less DRAM traffic).
Status rows_to_pool(const void* rows, int64_t width, const DevicePlan& plan, const Carved& c, const LayerDims& d,
                    cudaStream_t stream) {
  return scatter_rows(rows, d.tokens, width, plan.route_row, d.top_k, plan.row_src, plan.pool_rows, c.capacity,
                      c.xdy_pool, stream);
}

// The bf16 layer's memory-bound steps as side jobs of its GEMMs (the idle
// producer warps: GroupedGemmArgs::side_gather, side_combine) instead of
// kernels of their own (-DMEGAMOE_SIDE_JOBS, on by default; 30B: -2%, perf-log
// session 36). The forward's kGateUp gathers x itself (gate_up); the backward
// scatters dy into the pool (scatter_rows; kDownGrad gathering dy itself was 70 us slower
// than the two kernels at 30B, and storing the gathered rows as dW2's pool
// too 0.15-0.2 ms slower in f+b, sessions 36-37), then kDownGrad, dW2 (the last
// reader of dy's pool), kGateUpGrad scattering x into the pool, dW13 combining
// dx from kGateUpGrad's slots.
using detail::kSideJobs;
bool side_jobs(const LayerDims& d) { return kSideJobs && !fp8_backward(d) && !gathers_rows(d); }

Status backward_with_side_jobs(const LayerCall& call, const DevicePlan& plan, const Carved& c, const LayerInputs& in,
                               const void* dy, const LayerGrads& grads, int sms) {
  const LayerDims& d = call.dims;
  const int64_t H = d.hidden, I = d.intermediate, C = c.capacity;
  MEGAMOE_RETURN_IF_ERROR(rows_to_pool(dy, H, plan, c, d, call.stream));
  MEGAMOE_RETURN_IF_ERROR(
      detail::down_grad_gemm(call, plan, c, in.w2, in.topk_weights, grads.d_topk_weights, sms));
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(
      detail::weight_grad(call, plan, C, c.xdy_pool, H, c.a_pool, I, grads.dw2, grads), sms, call.stream));
  GroupedGemmArgs gx = detail::gate_up_grad(call, plan, c, in.w13);
  gx.side_gather = detail::pool_side_scatter(in.x, H, plan, c);  // x into the pool dW2 has finished with
  MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(gx, sms, call.stream));
  GroupedGemmArgs dw13 = detail::weight_grad(call, plan, C, c.dz_pool, 2 * I, c.xdy_pool, H, grads.dw13, grads);
  GroupedGemmArgs::SideCombine& dx = dw13.side_combine;  // dx from kGateUpGrad's slots
  dx.slots = c.slots, dx.slot_tokens = d.tokens;
  dx.topk_idx = in.topk_idx, dx.tokens = d.tokens, dx.begin = 0, dx.end = d.tokens;
  dx.top_k = d.top_k, dx.num_experts = d.num_experts, dx.hidden = H;
  dx.error_key = c.pv.plan.error_key;
  dx.out = grads.dx;
  return launch_grouped_gemm(dw13, sms, call.stream);
}

// `rows` (the token rows [T, cols]) as g's gathered operand `which`.
void gather_in_gemm(GroupedGemmArgs& g, GroupedGemmArgs::Gather which, const void* rows, const LayerDims& d) {
  (which == GroupedGemmArgs::Gather::kA ? g.a : g.b) = rows;
  g.gather = which, g.gather_tokens = d.tokens;
}

// The bf16 forward's kDown writes its rows in pool order, into x's pool
// (which kGateUp has finished reading), and the combine sums them by route
// (GroupedGemmArgs::down_to_pool, combine_pool_rows), instead of slots
// [j][t] (-DMEGAMOE_DOWN_POOL, on by default: kDown -5% at 30B, -4% at 235B,
// session 38; 150 back-to-back fwd+bwd steps at 30B -0.4%, session 40).
#ifdef MEGAMOE_DOWN_POOL
constexpr bool kDownPool = true;
#else
constexpr bool kDownPool = false;
#endif
bool down_in_pool(const LayerDims& d, const Carved& c) {
  return kDownPool && !fp8_forward(d) && d.hidden % 256 == 0 && c.xdy_pool != nullptr;
}

// x gathered into the pool (or by the GEMM: gathers_rows; or by its idle
// producer warps, its tiles held on the rows' counts: side jobs), then
// GEMM1 + SwiGLU in the forward's precision: z into z_pool, a into a_pool
// (either may be null). FP8 quantises the token rows as it scatters them
// into the pool (no bf16 x pool).
Status gate_up(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f, const void* x,
               const void* w13, void* z_pool, void* a_pool, int sms) {
  if (fp8_forward(call.dims)) return fp8_gate_up(call, plan, c, f, x, w13, z_pool, a_pool, sms);
  const LayerDims& d = call.dims;
  GroupedGemmArgs g = pool_gemm(GemmMode::kGateUp, call, plan, c.capacity, c.xdy_pool, d.hidden, w13,
                                d.num_experts * 2 * d.intermediate, d.hidden, d.intermediate);
  g.out0 = z_pool, g.out1 = a_pool;
  if (gathers_rows(d)) {
    gather_in_gemm(g, GroupedGemmArgs::Gather::kA, x, d);
    return launch_grouped_gemm(g, sms, call.stream);
  }
  if (kSideJobs) {
    GroupedGemmArgs own = g;
    MEGAMOE_RETURN_IF_ERROR(detail::gather_own_a(own, x, c, call.stream));
    bool launched = false;
    MEGAMOE_RETURN_IF_ERROR(detail::launch_holding_own_rows(own, sms, call.stream, &launched));
    if (launched) return Status::Ok();
  }
  MEGAMOE_RETURN_IF_ERROR(rows_to_pool(x, d.hidden, plan, c, d, call.stream));
  return launch_grouped_gemm(g, sms, call.stream);
}

// GEMM2 x routing weight into the slots (down_in_pool: into x's pool, in
// pool order), in the forward's precision.
Status down(const LayerCall& call, const DevicePlan& plan, const Carved& c, const Fp8Carved& f, const void* w2,
            const float* topk_weights, int sms) {
  if (fp8_forward(call.dims)) return fp8_down(call, plan, c, f, w2, topk_weights, sms);
  const LayerDims& d = call.dims;
  GroupedGemmArgs g = pool_gemm(GemmMode::kDown, call, plan, c.capacity, c.a_pool, d.intermediate, w2,
                                d.num_experts * d.hidden, d.intermediate, d.hidden);
  g.topk_weights = topk_weights, g.out0 = c.slots;
  if (down_in_pool(d, c)) g.out0 = c.xdy_pool, g.down_to_pool = true;
  return launch_grouped_gemm(g, sms, call.stream);
}

}  // namespace

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

Status fill_layer_fp8_weights(const LayerDims& dims, int device, cudaStream_t stream, const void* w13,
                              const void* w2, const LayerBuffers& buffers) {
  if (!fp8_backward(dims))
    return invalid_argument(std::string("fp8 weights: precision ") + to_string(dims.precision) + " has none");
  MEGAMOE_RETURN_IF_ERROR(check_fp8_weights(dims, buffers));
  MEGAMOE_RETURN_IF_ERROR(check_hopper(device));
  LayerCall call;
  call.dims = dims, call.device = device, call.stream = stream;
  detail::Fp8Carved f{};
  MEGAMOE_RETURN_IF_ERROR(detail::carve_fp8_weights(dims, buffers.fp8_weights, &f));
  return detail::fill_fp8_weights(call, f, w13, w2);
}

Status layer_forward(const LayerCall& call, const LayerInputs& in, void* y, const LayerBuffers& buffers) {
  if (call.slots_at_sources) return invalid_argument("layer_forward: an expert-parallel owner's call (no slots region)");
  const LayerDims& d = call.dims;
  Carved c;
  MEGAMOE_RETURN_IF_ERROR(carve(call, buffers, &c));
  Fp8Carved f;  // null regions unless the precision quantises
  MEGAMOE_RETURN_IF_ERROR(carve_fp8(call, buffers, &f));
  MEGAMOE_RETURN_IF_ERROR(refresh_fp8_weights(call, buffers, f, in, fp8_forward(d)));
  const int64_t H = d.hidden, T = d.tokens;
  const int sms = sm_count(call.device);
  MEGAMOE_RETURN_IF_ERROR(build_device_plan(in.topk_idx, T, d.top_k, d.num_experts, c.pv.plan, call.stream));
  const DevicePlan plan = device_plan(c.pv.plan, d);
  void* z_keep = buffers.saved != nullptr ? c.pv.z_pool : nullptr;  // z is kept only for a backward
  MEGAMOE_RETURN_IF_ERROR(gate_up(call, plan, c, f, in.x, in.w13, z_keep, c.a_pool, sms));
  MEGAMOE_RETURN_IF_ERROR(down(call, plan, c, f, in.w2, in.topk_weights, sms));

  if (down_in_pool(d, c))
    return combine_pool_rows(c.xdy_pool, c.pv.plan.route_row, in.topk_idx, T, d.top_k, d.num_experts, H,
                             c.pv.plan.error_key, call.errors, y, call.stream);
  return combine_slots(c.slots, in.topk_idx, T, d.top_k, d.num_experts, H, c.pv.plan.error_key, call.errors, y,
                       call.stream);
}

Status layer_backward(const LayerCall& call, const LayerInputs& in, const void* dy, const LayerGrads& grads,
                      const LayerBuffers& buffers) {
  if (call.slots_at_sources) return invalid_argument("layer_backward: an expert-parallel owner's call (no slots region)");
  const LayerDims& d = call.dims;
  Carved c;
  MEGAMOE_RETURN_IF_ERROR(carve(call, buffers, &c));
  Fp8Carved f;  // null regions unless the precision quantises
  MEGAMOE_RETURN_IF_ERROR(carve_fp8(call, buffers, &f));
  MEGAMOE_RETURN_IF_ERROR(refresh_fp8_weights(call, buffers, f, in, true));
  const int64_t H = d.hidden, I = d.intermediate, C = c.capacity, T = d.tokens;
  const int sms = sm_count(call.device);
  const DevicePlan plan = device_plan(c.pv.plan, d);

  if (buffers.saved == nullptr) {  // nothing saved: rebuild the plan and z in scratch, as the forward made it
    MEGAMOE_RETURN_IF_ERROR(build_device_plan(in.topk_idx, T, d.top_k, d.num_experts, c.pv.plan, call.stream));
    MEGAMOE_RETURN_IF_ERROR(gate_up(call, plan, c, f, in.x, in.w13, c.pv.z_pool, nullptr, sms));
  }
  // bf16: xdy_pool now takes dy (x is gathered again for dW13 at the end). FP8: dy's token rows are
  // quantised as they are scattered into the pool (no bf16 dy pool; dy^T and x^T come from the token rows).
  // ga = dy @ w2[e] (fused: d topk_w partials, dz, topk_w * a), d topk_w, then the dx slots = dz @ w13[e].
  if (side_jobs(d))  // (above: four GEMMs with x's gather and dx's combine aboard)
    return backward_with_side_jobs(call, plan, c, in, dy, grads, sms);
  if (fp8_backward(d)) {
    MEGAMOE_RETURN_IF_ERROR(
        fp8_data_grad_gemms(call, plan, c, f, dy, in.w2, in.w13, in.topk_weights, grads.d_topk_weights, sms));
  } else {
    if (!gathers_rows(d))
      MEGAMOE_RETURN_IF_ERROR(rows_to_pool(dy, H, plan, c, d, call.stream));
    MEGAMOE_RETURN_IF_ERROR(detail::data_grad_gemms(call, plan, c, in.w2, in.w13, in.topk_weights,
                                                    grads.d_topk_weights, sms, nullptr,
                                                    gathers_rows(d) ? dy : nullptr));
  }
  // dx: the fixed-order sum of its slots.
  MEGAMOE_RETURN_IF_ERROR(combine_slots(c.slots, in.topk_idx, T, d.top_k, d.num_experts, H, c.pv.plan.error_key,
                                        call.errors, grads.dx, call.stream));

  // dW2[e] = dy^T (w a); then x back into the pool for dW13[e] = dz^T x (FP8:
  // dy^T and x^T straight into e4m3 as dy's and x's token rows are gathered,
  // no bf16 pools). FP8: the data gradients', dW2's and dW13's e4m3 operands
  // share one scratch area (Fp8Layout): these steps must stay in this order
  // on this stream.
  if (fp8_backward(d)) {
    MEGAMOE_RETURN_IF_ERROR(fp8_down_weight_grad(call, plan, c, f, dy, grads, sms));
    return fp8_gate_up_weight_grad(call, plan, c, f, in.x, grads, sms);
  }
  if (gathers_rows(d)) {  // dy's and x's rows gathered by the GEMMs (the experiment above)
    GroupedGemmArgs dw2 = detail::weight_grad(call, plan, C, nullptr, H, c.a_pool, I, grads.dw2, grads);
    gather_in_gemm(dw2, GroupedGemmArgs::Gather::kA, dy, d);
    MEGAMOE_RETURN_IF_ERROR(launch_grouped_gemm(dw2, sms, call.stream));
    GroupedGemmArgs dw13 = detail::weight_grad(call, plan, C, c.dz_pool, 2 * I, nullptr, H, grads.dw13, grads);
    gather_in_gemm(dw13, GroupedGemmArgs::Gather::kB, in.x, d);
    return launch_grouped_gemm(dw13, sms, call.stream);
  }
  MEGAMOE_RETURN_IF_ERROR(weight_grad_gemm(call, plan, C, c.xdy_pool, H, f.dy_t, f.dy_ts, c.a_pool, I, f.wa_t,
                                           f.wa_ts, grads.dw2, grads, sms));
  MEGAMOE_RETURN_IF_ERROR(rows_to_pool(in.x, H, plan, c, d, call.stream));
  return weight_grad_gemm(call, plan, C, c.dz_pool, 2 * I, f.dz_t, f.dz_ts, c.xdy_pool, H, f.x_t, f.x_ts, grads.dw13,
                          grads, sms);
}

}  // namespace megamoe::cuda
