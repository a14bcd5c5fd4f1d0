// Every gradient of the reference (dx, d topk_w, dW13, dW2) against central
// finite differences of L = <y, dy> in fp64 on tiny shapes.
#include <random>

#include "test_util.h"

namespace megamoe::testing {
namespace {

struct FdCase {
  const char* name;
  int P;
  int64_t T;
  int E, k;
  Routing routing;
};
void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name; }  // test names without hex dumps

class FiniteDifference : public ::testing::TestWithParam<FdCase> {
 protected:
  void SetUp() override {
    const FdCase& c = GetParam();
    problem_ = make_problem(c.T, 128, 128, c.E, c.k, c.P);
    for (int r = 0; r < c.P; ++r) {
      LayerSpec spec;
      spec.problem = problem_;
      spec.float_dtype = DType::kF64;
      spec.routing = c.routing;
      spec.seed = 42;
      spec.rank = r;
      data_.push_back(make_layer_data(spec));
    }
  }

  // L = sum_r <y_r, dy_r>
  double loss() {
    std::vector<MoeInputs> in;
    std::vector<TensorView> ys;
    std::vector<HostTensor> y;
    for (const LayerData& d : data_) {
      y.emplace_back(DType::kF64, std::initializer_list<int64_t>{d.x.view.shape[0], problem_.hidden});
      in.push_back(d.inputs());
    }
    for (HostTensor& t : y) ys.push_back(t.view);
    const Status st = reference::simulate_forward(problem_, options(), in, ys, nullptr);
    EXPECT_TRUE(st.ok()) << st.to_string();
    double l = 0;
    for (size_t r = 0; r < y.size(); ++r) {
      const std::vector<double> yv = y[r].to_f64(), dyv = data_[r].dy.to_f64();
      for (size_t i = 0; i < yv.size(); ++i) l += yv[i] * dyv[i];
    }
    return l;
  }

  std::vector<LayerOutputs> analytic() {
    std::vector<MoeInputs> in;
    std::vector<TensorView> ys, dys;
    std::vector<MoeGrads> grads;
    std::vector<LayerOutputs> out;
    for (const LayerData& d : data_) {
      out.push_back(make_layer_outputs(problem_, d.x.view.shape[0], DType::kF64, DType::kF64, std::nan("")));
      in.push_back(d.inputs());
      dys.push_back(d.dy.view);
    }
    for (LayerOutputs& o : out) {
      ys.push_back(o.y.view);
      grads.push_back(o.grads());
    }
    MoeSaved saved;
    Status st = reference::simulate_forward(problem_, options(), in, ys, &saved);
    EXPECT_TRUE(st.ok()) << st.to_string();
    st = reference::simulate_backward(problem_, options(), in, dys, saved, grads);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return out;
  }

  static MoeOptions options() {
    MoeOptions o = cpu_options();
    o.cpu_threads = 1;
    return o;
  }

  // Central difference of the loss w.r.t. element i of tensor t, against `grad`.
  void check(HostTensor& t, int64_t i, double grad, const char* what) {
    const double v = t.get(i), eps = 1e-5 * std::max(1.0, std::fabs(v));
    t.set(i, v + eps);
    const double lp = loss();
    t.set(i, v - eps);
    const double lm = loss();
    t.set(i, v);
    const double fd = (lp - lm) / (2 * eps);
    EXPECT_NEAR(grad, fd, 1e-6 * std::max(1.0, std::fabs(fd))) << what << " element " << i;
    ++checked_;
  }

  // Indices into [L, 2I, H] weights, half in gate rows, half in up rows, only in routed experts.
  std::vector<int64_t> weight_samples(int64_t rows, int64_t cols, bool split_halves, int n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int64_t> out;
    const int64_t L = problem_.experts_per_rank();
    for (int s = 0; s < n; ++s) {
      const int64_t l = static_cast<int64_t>(rng() % static_cast<uint64_t>(L));
      int64_t r = static_cast<int64_t>(rng() % static_cast<uint64_t>(rows));
      if (split_halves) r = (r % (rows / 2)) + (s % 2 ? rows / 2 : 0);
      const int64_t c = static_cast<int64_t>(rng() % static_cast<uint64_t>(cols));
      out.push_back((l * rows + r) * cols + c);
    }
    return out;
  }

  MoeProblem problem_;
  std::vector<LayerData> data_;
  int checked_ = 0;
};

TEST_P(FiniteDifference, Dx) {
  const std::vector<LayerOutputs> g = analytic();
  for (size_t r = 0; r < data_.size(); ++r)
    for (int64_t i = 0; i < data_[r].x.view.numel(); i += 7) check(data_[r].x, i, g[r].dx.get(i), "dx");
  EXPECT_GT(checked_, 0);
}

TEST_P(FiniteDifference, DTopkWeights) {
  const std::vector<LayerOutputs> g = analytic();
  for (size_t r = 0; r < data_.size(); ++r)
    for (int64_t i = 0; i < data_[r].topk_weights.view.numel(); ++i)
      check(data_[r].topk_weights, i, g[r].d_topk_weights.get(i), "d_topk_weights");
  EXPECT_GT(checked_, 0);
}

TEST_P(FiniteDifference, DW13GateAndUp) {
  const std::vector<LayerOutputs> g = analytic();
  const int64_t I = problem_.intermediate, H = problem_.hidden;
  for (size_t r = 0; r < data_.size(); ++r)
    for (int64_t i : weight_samples(2 * I, H, true, 40, 7 + r)) check(data_[r].w13, i, g[r].dw13.get(i), "dw13");
  EXPECT_GT(checked_, 0);
}

TEST_P(FiniteDifference, DW2) {
  const std::vector<LayerOutputs> g = analytic();
  const int64_t I = problem_.intermediate, H = problem_.hidden;
  for (size_t r = 0; r < data_.size(); ++r)
    for (int64_t i : weight_samples(H, I, false, 40, 11 + r)) check(data_[r].w2, i, g[r].dw2.get(i), "dw2");
  EXPECT_GT(checked_, 0);
}

// The analytic gradients are not trivially zero (a check against 0 would pass FD of a constant).
TEST_P(FiniteDifference, GradientsAreNonTrivial) {
  const std::vector<LayerOutputs> g = analytic();
  double norm = 0;
  for (const HostTensor* t : {&g[0].dx, &g[0].d_topk_weights, &g[0].dw13, &g[0].dw2}) {
    double n = 0;
    for (double v : t->to_f64()) n += v * v;
    EXPECT_GT(n, 0.0);
    norm += n;
  }
  EXPECT_TRUE(std::isfinite(norm));
}

INSTANTIATE_TEST_SUITE_P(Reference, FiniteDifference,
                         ::testing::Values(FdCase{"p1_k2", 1, 5, 4, 2, Routing::kUniform},
                                           FdCase{"p1_k3_drops", 1, 6, 4, 3, Routing::kWithDrops},
                                           FdCase{"p2_k2", 2, 3, 4, 2, Routing::kUniform}),
                         [](const ::testing::TestParamInfo<FdCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace megamoe::testing
