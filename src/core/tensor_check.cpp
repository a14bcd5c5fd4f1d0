#include "core/tensor_check.h"

#include <string>

namespace megamoe {

namespace {
std::string dtype_list(std::initializer_list<DType> dtypes) {
  std::string out;
  for (DType d : dtypes) out += (out.empty() ? "" : " or ") + std::string(to_string(d));
  return out;
}
std::string shape_str(std::initializer_list<int64_t> shape) {
  std::string out = "[";
  bool first = true;
  for (int64_t d : shape) {
    out += (first ? "" : ", ") + std::to_string(d);
    first = false;
  }
  return out + "]";
}
}  // namespace

Status check_view(const char* name, const TensorView& v, std::initializer_list<int64_t> shape,
                  std::initializer_list<DType> dtypes, DeviceType device) {
  const std::string n(name);
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok |= v.dtype == d;
  if (!dtype_ok)
    return invalid_argument(n + ": expected dtype " + dtype_list(dtypes) + ", got " + to_string(v.dtype));
  bool shape_ok = v.rank == static_cast<int>(shape.size()) && v.rank <= TensorView::kMaxRank;
  int i = 0;
  for (int64_t d : shape) shape_ok = shape_ok && v.shape[i++] == d;
  if (!shape_ok) return invalid_argument(n + ": expected shape " + shape_str(shape) + ", got " + v.shape_string());
  if (v.device != device)
    return invalid_argument(n + ": expected a " + to_string(device) + " tensor, got " + to_string(v.device));
  if (v.data == nullptr && v.numel() > 0) return invalid_argument(n + ": data pointer is null");
  return Status::Ok();
}

Status check_inputs(const MoeProblem& p, const MoeInputs& in, DeviceType device, FloatMode* mode) {
  if (in.x.dtype != DType::kBF16 && in.x.dtype != DType::kF64)
    return invalid_argument(std::string("x: expected dtype bf16 (or f64 for the reference's exact mode), got ") +
                            to_string(in.x.dtype));
  *mode = in.x.dtype == DType::kBF16 ? FloatMode::kBF16 : FloatMode::kF64;
  const DType wt = *mode == FloatMode::kBF16 ? DType::kBF16 : DType::kF64;
  const DType rt = *mode == FloatMode::kBF16 ? DType::kF32 : DType::kF64;
  if (in.x.rank != 2) return invalid_argument("x: expected shape [T, H], got " + in.x.shape_string());
  const int64_t T = in.x.shape[0], H = p.hidden, I = p.intermediate, k = p.top_k, L = p.experts_per_rank();
  MEGAMOE_RETURN_IF_ERROR(check_view("x", in.x, {T, H}, {wt}, device));
  MEGAMOE_RETURN_IF_ERROR(check_view("topk_idx", in.topk_idx, {T, k}, {DType::kI32}, device));
  MEGAMOE_RETURN_IF_ERROR(check_view("topk_weights", in.topk_weights, {T, k}, {rt}, device));
  MEGAMOE_RETURN_IF_ERROR(check_view("w13", in.w13, {L, 2 * I, H}, {wt}, device));
  MEGAMOE_RETURN_IF_ERROR(check_view("w2", in.w2, {L, H, I}, {wt}, device));
  return Status::Ok();
}

Status check_output(const char* name, const TensorView& v, int64_t tokens, int64_t hidden, FloatMode mode,
                    DeviceType device) {
  return check_view(name, v, {tokens, hidden}, {mode == FloatMode::kBF16 ? DType::kBF16 : DType::kF64}, device);
}

Status check_grads(const MoeProblem& p, const MoeOptions& o, const MoeGrads& g, int64_t tokens, FloatMode mode,
                   DeviceType device) {
  const int64_t H = p.hidden, I = p.intermediate, k = p.top_k, L = p.experts_per_rank();
  MEGAMOE_RETURN_IF_ERROR(check_output("dx", g.dx, tokens, H, mode, device));
  const bool exact = mode == FloatMode::kF64;
  MEGAMOE_RETURN_IF_ERROR(
      check_view("d_topk_weights", g.d_topk_weights, {tokens, k}, {exact ? DType::kF64 : DType::kF32}, device));
  if (exact) {
    MEGAMOE_RETURN_IF_ERROR(check_view("dw13", g.dw13, {L, 2 * I, H}, {DType::kF64}, device));
    MEGAMOE_RETURN_IF_ERROR(check_view("dw2", g.dw2, {L, H, I}, {DType::kF64}, device));
  } else if (o.accumulate_weight_grads) {
    MEGAMOE_RETURN_IF_ERROR(check_view("dw13 (accumulate_weight_grads)", g.dw13, {L, 2 * I, H}, {DType::kF32}, device));
    MEGAMOE_RETURN_IF_ERROR(check_view("dw2 (accumulate_weight_grads)", g.dw2, {L, H, I}, {DType::kF32}, device));
  } else {
    MEGAMOE_RETURN_IF_ERROR(check_view("dw13", g.dw13, {L, 2 * I, H}, {DType::kBF16, DType::kF32}, device));
    MEGAMOE_RETURN_IF_ERROR(check_view("dw2", g.dw2, {L, H, I}, {DType::kBF16, DType::kF32}, device));
  }
  return Status::Ok();
}

}  // namespace megamoe
