#include "testing/sample_check.h"

#include <algorithm>
#include <cmath>

#include "reference/moe_reference.h"

namespace megamoe::testing {
namespace {

// ||a[rows] - b|| / ||b|| where a's selected rows are compared with b's rows in order.
double rows_error(const HostTensor& full, const std::vector<int64_t>& rows, const HostTensor& sub) {
  const int64_t w = full.view.numel() / std::max<int64_t>(1, full.view.shape[0]);
  double num = 0, den = 0;
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t c = 0; c < w; ++c) {
      const double a = full.get(rows[i] * w + c), b = sub.get(static_cast<int64_t>(i) * w + c);
      num += (a - b) * (a - b);
      den += b * b;
    }
  if (std::isnan(num)) return num;
  return den == 0 ? (num == 0 ? 0 : INFINITY) : std::sqrt(num / den);
}

double slice_error(const TensorView& full, int64_t offset, const HostTensor& sub) {
  double num = 0, den = 0;
  const int64_t n = sub.view.numel();
  std::vector<double> a(static_cast<size_t>(n));
  reference::load_elements(full, offset, n, a.data());
  for (int64_t i = 0; i < n; ++i) {
    const double b = sub.get(i);
    num += (a[i] - b) * (a[i] - b);
    den += b * b;
  }
  if (std::isnan(num)) return num;
  return den == 0 ? (num == 0 ? 0 : INFINITY) : std::sqrt(num / den);
}

const reference::Numerics kFp64{true, Precision::kBF16, ScaleMode::kFloat32};

}  // namespace

Status check_sample_against_fp64(const MoeProblem& problem, const std::vector<LayerData>& data,
                                 const std::vector<LayerOutputs>& outputs, int64_t sample_tokens, int threads,
                                 SampleErrors* errors) {
  const int P = problem.ep_size, k = problem.top_k;
  const int64_t H = problem.hidden, I = problem.intermediate, L = problem.experts_per_rank();
  const DType wd = data[0].topk_weights.view.dtype;

  // ---- token sample on rank 0, all routes; other ranks send nothing.
  const int64_t T0 = data[0].x.view.shape[0];
  const int64_t S = std::min(sample_tokens, T0);
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < S; ++i) rows.push_back(i * T0 / S);
  std::vector<LayerData> sub(static_cast<size_t>(P));
  std::vector<MoeInputs> in;
  std::vector<TensorView> y, dy;
  std::vector<LayerOutputs> out;
  std::vector<MoeGrads> grads;
  for (int r = 0; r < P; ++r) {
    const int64_t n = r == 0 ? S : 0;
    LayerData& d = sub[r];
    d.x = HostTensor(data[r].x.view.dtype, {n, H});
    d.dy = HostTensor(data[r].dy.view.dtype, {n, H});
    d.topk_idx = HostTensor(DType::kI32, {n, k});
    d.topk_weights = HostTensor(wd, {n, k});
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = 0; c < H; ++c) {
        d.x.set(i * H + c, data[0].x.get(rows[i] * H + c));
        d.dy.set(i * H + c, data[0].dy.get(rows[i] * H + c));
      }
      for (int j = 0; j < k; ++j) {
        d.topk_idx.set(i * k + j, data[0].topk_idx.get(rows[i] * k + j));
        d.topk_weights.set(i * k + j, data[0].topk_weights.get(rows[i] * k + j));
      }
    }
    in.push_back({d.x.view, d.topk_idx.view, d.topk_weights.view, data[r].w13.view, data[r].w2.view});
    dy.push_back(d.dy.view);
    LayerOutputs o;
    o.y = HostTensor(DType::kF64, {n, H});
    o.dx = HostTensor(DType::kF64, {n, H});
    o.d_topk_weights = HostTensor(DType::kF64, {n, k});
    y.push_back(o.y.view);
    grads.push_back({o.dx.view, o.d_topk_weights.view, TensorView{}, TensorView{}});
    out.push_back(std::move(o));
  }
  MoeSaved saved;
  MEGAMOE_RETURN_IF_ERROR(reference::run_forward(problem, kFp64, SavePolicy::kKeep, threads, in, y, &saved));
  MEGAMOE_RETURN_IF_ERROR(reference::run_backward(problem, kFp64, threads, in, dy, saved, grads, false));
  errors->sampled_tokens = S;
  errors->y = rows_error(outputs[0].y, rows, out[0].y);
  errors->dx = rows_error(outputs[0].dx, rows, out[0].dx);
  errors->d_topk_weights = rows_error(outputs[0].d_topk_weights, rows, out[0].d_topk_weights);

  // ---- expert sample: rank 0's most loaded local expert, only its routes.
  std::vector<int64_t> load(static_cast<size_t>(L), 0);
  for (int r = 0; r < P; ++r)
    for (int64_t i = 0; i < data[r].topk_idx.view.numel(); ++i) {
      const int32_t e = data[r].topk_idx.data<int32_t>()[i];
      if (e >= 0 && e < L) ++load[e];
    }
  const int64_t l = std::max_element(load.begin(), load.end()) - load.begin();
  errors->sampled_expert = static_cast<int>(l);
  errors->expert_rows = load[l];
  MoeProblem one = problem;  // one local expert per rank; only rank 0's gets routes
  one.num_experts = P;
  one.top_k = 1;
  std::vector<LayerData> route(static_cast<size_t>(P));
  in.clear();
  dy.clear();
  std::vector<TensorView> no_y;
  std::vector<MoeGrads> wgrads;
  HostTensor dw13(DType::kF64, {1, 2 * I, H}), dw2(DType::kF64, {1, H, I});
  for (int r = 0; r < P; ++r) {
    const int64_t T = data[r].x.view.shape[0];
    LayerData& d = route[r];
    d.topk_idx = HostTensor(DType::kI32, {T, 1});
    d.topk_weights = HostTensor(wd, {T, 1});
    for (int64_t t = 0; t < T; ++t) {
      d.topk_idx.set(t, -1);
      for (int j = 0; j < k; ++j)
        if (data[r].topk_idx.get(t * k + j) == static_cast<double>(l)) {
          d.topk_idx.set(t, 0);
          d.topk_weights.set(t, data[r].topk_weights.get(t * k + j));
        }
    }
    const TensorView w13 = slice0(data[0].w13.view, l, 1), w2 = slice0(data[0].w2.view, l, 1);
    in.push_back({data[r].x.view, d.topk_idx.view, d.topk_weights.view, w13, w2});
    dy.push_back(data[r].dy.view);
    no_y.push_back(TensorView{});
    wgrads.push_back({TensorView{}, TensorView{}, r == 0 ? dw13.view : TensorView{}, r == 0 ? dw2.view : TensorView{}});
  }
  MoeSaved saved1;
  MEGAMOE_RETURN_IF_ERROR(reference::run_forward(one, kFp64, SavePolicy::kKeep, threads, in, no_y, &saved1));
  MEGAMOE_RETURN_IF_ERROR(reference::run_backward(one, kFp64, threads, in, dy, saved1, wgrads, false));
  errors->dw13 = slice_error(outputs[0].dw13.view, l * 2 * I * H, dw13);
  errors->dw2 = slice_error(outputs[0].dw2.view, l * H * I, dw2);
  return Status::Ok();
}

}  // namespace megamoe::testing
