// The reference layer: low-precision paths against the fp64 path with stated
// bounds, P-rank simulation against P = 1, save policies, determinism and
// algebraic identities of forward and backward.
#include "test_util.h"

namespace megamoe {
// Test names without hex dumps (SavePolicies is parameterised by the bare enum; ADL finds this here).
void PrintTo(Precision p, std::ostream* os) { *os << to_string(p); }
}  // namespace megamoe

namespace megamoe::testing {
namespace {

LayerData make_data(const MoeProblem& p, DType dtype, Routing routing = Routing::kUniform, uint64_t seed = 3,
                    int rank = 0) {
  LayerSpec s;
  s.problem = p;
  s.float_dtype = dtype;
  s.routing = routing;
  s.seed = seed;
  s.rank = rank;
  return make_layer_data(s);
}

// ---------------------------------------------------------------------------
// Low precision vs fp64. Bounds (relative Frobenius error of each output):
//  bf16: u = 2^-8. Every output is stored in bf16 (rms relative error ~u/sqrt(3)
//    = 2.3e-3 from the last rounding alone) after 2-3 bf16-rounded
//    intermediates (z, a, slots); errors of independent roundings add in
//    quadrature, ~5e-3 expected. Bound 1.5e-2 (about 4u).
//  fp8 (e4m3, 3 mantissa bits): relative rounding error of an operand element
//    is up to 2^-4, rms ~2-3.5e-2; a GEMM with both operands quantised ~4e-2,
//    and two chained GEMMs ~6e-2. Bound 1e-1.
struct PrecisionCase {
  const char* name;
  Precision precision;
  ScaleMode scale;
  double fwd_bound, bwd_bound;
};
void PrintTo(const PrecisionCase& c, std::ostream* os) { *os << c.name; }  // test names without hex dumps

class LowPrecisionVsFp64 : public ::testing::TestWithParam<PrecisionCase> {};

TEST_P(LowPrecisionVsFp64, AllOutputsWithinBound) {
  const PrecisionCase& c = GetParam();
  struct Shape {
    int64_t T, H, I;
    int E, k;
    Routing routing;
  };
  for (const Shape& s : {Shape{100, 128, 128, 8, 2, Routing::kUniform}, Shape{129, 256, 128, 16, 4, Routing::kWithDrops},
                         Shape{64, 128, 256, 4, 1, Routing::kOneExpert}, Shape{40, 128, 128, 8, 8, Routing::kFirstHalf}}) {
    const MoeProblem p = make_problem(s.T, s.H, s.I, s.E, s.k);
    const LayerData d = make_data(p, DType::kBF16, s.routing);
    MoeOptions o = cpu_options(c.precision);
    o.fp8_scale_mode = c.scale;
    const LayerOutputs got = run_layer(p, o, d);
    const LayerOutputs ref = run_layer(p, cpu_options(), to_f64(d));
    SCOPED_TRACE("T=" + std::to_string(s.T) + " H=" + std::to_string(s.H) + " k=" + std::to_string(s.k));
    for (const HostTensor* t : {&got.y, &got.dx, &got.d_topk_weights, &got.dw13, &got.dw2})
      EXPECT_TRUE(all_finite(*t)) << "an output element was not written (NaN poison left)";
    EXPECT_LT(relative_error(got.y, ref.y), c.fwd_bound);
    EXPECT_LT(relative_error(got.dx, ref.dx), c.bwd_bound);
    EXPECT_LT(relative_error(got.d_topk_weights, ref.d_topk_weights), c.bwd_bound);
    EXPECT_LT(relative_error(got.dw13, ref.dw13), c.bwd_bound);
    EXPECT_LT(relative_error(got.dw2, ref.dw2), c.bwd_bound);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Reference, LowPrecisionVsFp64,
    ::testing::Values(PrecisionCase{"bf16", Precision::kBF16, ScaleMode::kFloat32, 1.5e-2, 1.5e-2},
                      PrecisionCase{"fp8", Precision::kFP8, ScaleMode::kFloat32, 1e-1, 1e-1},
                      PrecisionCase{"fp8_pow2", Precision::kFP8, ScaleMode::kPowerOfTwo, 1e-1, 1e-1},
                      PrecisionCase{"fp8_bwd", Precision::kFP8Bwd, ScaleMode::kFloat32, 1.5e-2, 1e-1},
                      PrecisionCase{"mxfp8", Precision::kMXFP8, ScaleMode::kFloat32, 1e-1, 1e-1}),
    [](const ::testing::TestParamInfo<PrecisionCase>& i) { return std::string(i.param.name); });

// The quantised modes really quantise: their error is well above bf16's.
TEST(LowPrecision, Fp8ErrorIsAboveBf16Error) {
  const MoeProblem p = make_problem(100, 128, 128, 8, 2);
  const LayerData d = make_data(p, DType::kBF16);
  const LayerOutputs ref = run_layer(p, cpu_options(), to_f64(d));
  const LayerOutputs bf = run_layer(p, cpu_options(Precision::kBF16), d);
  const LayerOutputs f8 = run_layer(p, cpu_options(Precision::kFP8), d);
  const LayerOutputs mx = run_layer(p, cpu_options(Precision::kMXFP8), d);
  EXPECT_GT(relative_error(f8.y, ref.y), 2 * relative_error(bf.y, ref.y));
  EXPECT_GT(relative_error(f8.dw13, ref.dw13), 2 * relative_error(bf.dw13, ref.dw13));
  EXPECT_GT(relative_error(mx.dx, ref.dx), 2 * relative_error(bf.dx, ref.dx));
  EXPECT_FALSE(bitwise_equal(f8.y, mx.y));
}

TEST(LowPrecision, Fp8BwdForwardIsTheBf16Forward) {
  const MoeProblem p = make_problem(77, 128, 128, 8, 3);
  const LayerData d = make_data(p, DType::kBF16, Routing::kWithDrops);
  const LayerOutputs bf = run_layer(p, cpu_options(Precision::kBF16), d);
  const LayerOutputs mixed = run_layer(p, cpu_options(Precision::kFP8Bwd), d);
  const LayerOutputs f8 = run_layer(p, cpu_options(Precision::kFP8), d);
  EXPECT_TRUE(bitwise_equal(bf.y, mixed.y));
  EXPECT_FALSE(bitwise_equal(bf.dx, mixed.dx));
  EXPECT_FALSE(bitwise_equal(f8.y, mixed.y));
}

// ---------------------------------------------------------------------------
// P ranks simulated == P = 1 bitwise: the same tokens in rank-major order and
// the same experts, split over ranks, give identical bytes for every output.
struct EpCase {
  int P;
  Precision precision;
};
void PrintTo(const EpCase& c, std::ostream* os) { *os << "P" << c.P << "_" << to_string(c.precision); }
class EpSimulation : public ::testing::TestWithParam<EpCase> {};

TEST_P(EpSimulation, EqualsSingleRankBitwise) {
  const int P = GetParam().P, E = 16, k = 4;
  std::vector<int64_t> tokens, offset{0};
  for (int r = 0; r < P; ++r) {
    tokens.push_back(20 + 7 * r);  // unequal token counts per rank
    offset.push_back(offset.back() + tokens.back());
  }
  const int64_t total = offset.back(), max_t = tokens.back();
  const MoeProblem p1 = make_problem(total, 128, 128, E, k);
  const LayerData d = make_data(p1, DType::kBF16, Routing::kWithDrops, 9);
  const MoeOptions o = cpu_options(GetParam().precision);
  const LayerOutputs one = run_layer(p1, o, d, DType::kBF16);

  MoeProblem pp = p1;
  pp.ep_size = P;
  pp.max_tokens_per_rank = max_t;
  const int64_t L = E / P;
  std::vector<MoeInputs> in;
  std::vector<TensorView> ys, dys;
  std::vector<MoeGrads> grads;
  std::vector<LayerOutputs> outs;
  for (int r = 0; r < P; ++r) {
    in.push_back({slice0(d.x.view, offset[r], tokens[r]), slice0(d.topk_idx.view, offset[r], tokens[r]),
                  slice0(d.topk_weights.view, offset[r], tokens[r]), slice0(d.w13.view, r * L, L),
                  slice0(d.w2.view, r * L, L)});
    dys.push_back(slice0(d.dy.view, offset[r], tokens[r]));
    outs.push_back(make_layer_outputs(pp, tokens[r], DType::kBF16, DType::kBF16, std::nan("")));
  }
  for (LayerOutputs& out : outs) {
    ys.push_back(out.y.view);
    grads.push_back(out.grads());
  }
  MoeSaved saved;
  Status st = reference::simulate_forward(pp, o, in, ys, &saved);
  ASSERT_TRUE(st.ok()) << st.to_string();
  st = reference::simulate_backward(pp, o, in, dys, saved, grads);
  ASSERT_TRUE(st.ok()) << st.to_string();

  auto same_bytes = [](const TensorView& a, const TensorView& b) {
    return a.size_bytes() == b.size_bytes() &&
           std::memcmp(a.data, b.data, static_cast<size_t>(a.size_bytes())) == 0;
  };
  for (int r = 0; r < P; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(same_bytes(outs[r].y.view, slice0(one.y.view, offset[r], tokens[r])));
    EXPECT_TRUE(same_bytes(outs[r].dx.view, slice0(one.dx.view, offset[r], tokens[r])));
    EXPECT_TRUE(same_bytes(outs[r].d_topk_weights.view, slice0(one.d_topk_weights.view, offset[r], tokens[r])));
    EXPECT_TRUE(same_bytes(outs[r].dw13.view, slice0(one.dw13.view, r * L, L)));
    EXPECT_TRUE(same_bytes(outs[r].dw2.view, slice0(one.dw2.view, r * L, L)));
  }
}

INSTANTIATE_TEST_SUITE_P(Reference, EpSimulation,
                         ::testing::Values(EpCase{2, Precision::kBF16}, EpCase{4, Precision::kBF16},
                                           EpCase{8, Precision::kBF16}, EpCase{2, Precision::kFP8},
                                           EpCase{4, Precision::kMXFP8}, EpCase{8, Precision::kFP8Bwd}),
                         [](const ::testing::TestParamInfo<EpCase>& i) {
                           return "P" + std::to_string(i.param.P) + "_" + to_string(i.param.precision);
                         });

// ---------------------------------------------------------------------------
// Save policies, determinism, threads.
class SavePolicies : public ::testing::TestWithParam<Precision> {};
TEST_P(SavePolicies, KeepAndRecomputeGiveIdenticalGradients) {
  const MoeProblem p = make_problem(90, 128, 128, 8, 2);
  const LayerData d = make_data(p, DType::kBF16, Routing::kWithDrops);
  const LayerOutputs keep = run_layer(p, cpu_options(GetParam(), SavePolicy::kKeep), d);
  const LayerOutputs rec = run_layer(p, cpu_options(GetParam(), SavePolicy::kRecompute), d);
  EXPECT_TRUE(bitwise_equal(keep.y, rec.y));
  EXPECT_TRUE(bitwise_equal(keep.dx, rec.dx));
  EXPECT_TRUE(bitwise_equal(keep.d_topk_weights, rec.d_topk_weights));
  EXPECT_TRUE(bitwise_equal(keep.dw13, rec.dw13));
  EXPECT_TRUE(bitwise_equal(keep.dw2, rec.dw2));
}
INSTANTIATE_TEST_SUITE_P(Reference, SavePolicies, ::testing::Values(Precision::kBF16, Precision::kFP8),
                         [](const ::testing::TestParamInfo<Precision>& i) { return std::string(to_string(i.param)); });

TEST(Determinism, RepeatedRunsAndThreadCountsAreBitwiseIdentical) {
  const MoeProblem p = make_problem(150, 128, 256, 8, 4);
  const LayerData d = make_data(p, DType::kBF16);
  MoeOptions o1 = cpu_options(Precision::kFP8), o3 = o1;
  o1.cpu_threads = 1;
  o3.cpu_threads = 3;
  const LayerOutputs a = run_layer(p, o1, d), b = run_layer(p, o3, d), c = run_layer(p, o3, d);
  for (auto pair : {std::make_pair(&a, &b), std::make_pair(&b, &c)}) {
    EXPECT_TRUE(bitwise_equal(pair.first->y, pair.second->y));
    EXPECT_TRUE(bitwise_equal(pair.first->dx, pair.second->dx));
    EXPECT_TRUE(bitwise_equal(pair.first->d_topk_weights, pair.second->d_topk_weights));
    EXPECT_TRUE(bitwise_equal(pair.first->dw13, pair.second->dw13));
    EXPECT_TRUE(bitwise_equal(pair.first->dw2, pair.second->dw2));
  }
}

TEST(EdgeCases, ZeroTokensWritesZeroWeightGradients) {
  const MoeProblem p = make_problem(0, 128, 128, 4, 2);
  const LayerData d = make_data(p, DType::kBF16);
  const LayerOutputs o = run_layer(p, cpu_options(), d);
  for (double v : o.dw13.to_f64()) ASSERT_EQ(v, 0.0);
  for (double v : o.dw2.to_f64()) ASSERT_EQ(v, 0.0);
}

TEST(EdgeCases, OneTokenAndAllRoutesDropped) {
  MoeProblem p = make_problem(1, 128, 128, 4, 2);
  LayerData d = make_data(p, DType::kBF16);
  const LayerOutputs one = run_layer(p, cpu_options(), d);
  EXPECT_TRUE(all_finite(one.y));
  for (int j = 0; j < 2; ++j) d.topk_idx.set(j, -1);
  const LayerOutputs none = run_layer(p, cpu_options(), d);
  for (const HostTensor* t : {&none.y, &none.dx, &none.d_topk_weights, &none.dw13, &none.dw2})
    for (double v : t->to_f64()) ASSERT_EQ(v, 0.0);
}

TEST(EdgeCases, AccumulateWeightGradsAddsToFp32Buffers) {
  const MoeProblem p = make_problem(50, 128, 128, 4, 2);
  const LayerData d = make_data(p, DType::kBF16);
  const LayerOutputs fresh = run_layer(p, cpu_options(), d);
  MoeOptions o = cpu_options();
  o.accumulate_weight_grads = true;
  LayerOutputs acc = make_layer_outputs(p, p.num_tokens, DType::kBF16, DType::kF32, 0.0);
  acc.dw13.fill(0.5);
  acc.dw2.fill(-0.25);
  MoeSaved saved;
  ASSERT_TRUE(moe_forward(p, o, d.inputs(), acc.y.view, &saved).ok());
  ASSERT_TRUE(moe_backward(p, o, d.inputs(), d.dy.view, saved, acc.grads()).ok());
  for (int64_t i = 0; i < fresh.dw13.view.numel(); i += 97)
    EXPECT_FLOAT_EQ(static_cast<float>(acc.dw13.get(i)), static_cast<float>(fresh.dw13.get(i) + 0.5));
  for (int64_t i = 0; i < fresh.dw2.view.numel(); i += 97)
    EXPECT_FLOAT_EQ(static_cast<float>(acc.dw2.get(i)), static_cast<float>(fresh.dw2.get(i) - 0.25));
}

// ---------------------------------------------------------------------------
// Identities, in the exact (fp64) mode.
class Identities : public ::testing::Test {
 protected:
  MoeProblem p_ = make_problem(12, 128, 128, 4, 2);
  LayerData d_ = make_data(p_, DType::kF64, Routing::kUniform, 17);
};

TEST_F(Identities, LinearInRoutingWeights) {
  const LayerOutputs a = run_layer(p_, cpu_options(), d_);
  for (int64_t i = 0; i < d_.topk_weights.view.numel(); ++i) d_.topk_weights.set(i, 2 * d_.topk_weights.get(i));
  const LayerOutputs b = run_layer(p_, cpu_options(), d_);
  for (int64_t i = 0; i < a.y.view.numel(); ++i) ASSERT_NEAR(b.y.get(i), 2 * a.y.get(i), 1e-12);
  for (int64_t i = 0; i < a.dx.view.numel(); ++i) ASSERT_NEAR(b.dx.get(i), 2 * a.dx.get(i), 1e-12);
  // d topk_w does not depend on the weights (it is <dy, o>)
  for (int64_t i = 0; i < a.d_topk_weights.view.numel(); ++i)
    ASSERT_NEAR(b.d_topk_weights.get(i), a.d_topk_weights.get(i), 1e-12);
}

TEST_F(Identities, DroppedRouteEqualsZeroWeight) {
  d_.topk_weights.set(3, 0.0);  // token 1, slot 1
  const LayerOutputs zero_w = run_layer(p_, cpu_options(), d_);
  d_.topk_idx.set(3, -1);
  const LayerOutputs dropped = run_layer(p_, cpu_options(), d_);
  EXPECT_LT(max_abs_diff(zero_w.y, dropped.y), 1e-14);
  EXPECT_LT(max_abs_diff(zero_w.dx, dropped.dx), 1e-14);
  EXPECT_LT(max_abs_diff(zero_w.dw13, dropped.dw13), 1e-14);
  EXPECT_LT(max_abs_diff(zero_w.dw2, dropped.dw2), 1e-14);
  EXPECT_EQ(dropped.d_topk_weights.get(3), 0.0);
  EXPECT_NE(zero_w.d_topk_weights.get(3), 0.0);  // a zero weight still has a gradient
}

TEST_F(Identities, ZeroDownProjectionZeroesEverythingButDW2) {
  d_.w2.fill(0.0);
  const LayerOutputs o = run_layer(p_, cpu_options(), d_);
  for (const HostTensor* t : {&o.y, &o.dx, &o.d_topk_weights, &o.dw13})
    for (double v : t->to_f64()) ASSERT_EQ(v, 0.0);
  double n = 0;
  for (double v : o.dw2.to_f64()) n += v * v;
  EXPECT_GT(n, 0.0);
}

// With identical experts and unit weights, y is k times one expert's output,
// and d topk_w[t, j] = <dy[t], o[t]> for every j.
TEST_F(Identities, IdenticalExpertsWithUnitWeights) {
  const int64_t per = 2 * p_.intermediate * p_.hidden, per2 = p_.hidden * p_.intermediate;
  for (int64_t l = 1; l < 4; ++l) {
    for (int64_t i = 0; i < per; ++i) d_.w13.set(l * per + i, d_.w13.get(i));
    for (int64_t i = 0; i < per2; ++i) d_.w2.set(l * per2 + i, d_.w2.get(i));
  }
  d_.topk_weights.fill(1.0);
  const LayerOutputs two = run_layer(p_, cpu_options(), d_);
  MoeProblem p1 = p_;
  p1.top_k = 1;
  LayerData d1 = make_data(p1, DType::kF64, Routing::kUniform, 17);
  for (int64_t i = 0; i < d_.x.view.numel(); ++i) d1.x.set(i, d_.x.get(i));
  for (int64_t i = 0; i < d_.dy.view.numel(); ++i) d1.dy.set(i, d_.dy.get(i));
  for (int64_t i = 0; i < d_.w13.view.numel(); ++i) d1.w13.set(i, d_.w13.get(i));
  for (int64_t i = 0; i < d_.w2.view.numel(); ++i) d1.w2.set(i, d_.w2.get(i));
  d1.topk_weights.fill(1.0);
  const LayerOutputs one = run_layer(p1, cpu_options(), d1);
  for (int64_t i = 0; i < two.y.view.numel(); ++i) ASSERT_NEAR(two.y.get(i), 2 * one.y.get(i), 1e-12);
  for (int64_t i = 0; i < two.dx.view.numel(); ++i) ASSERT_NEAR(two.dx.get(i), 2 * one.dx.get(i), 1e-12);
  const int64_t H = p_.hidden;
  for (int64_t t = 0; t < p_.num_tokens; ++t) {
    double dot = 0;
    for (int64_t h = 0; h < H; ++h) dot += d_.dy.get(t * H + h) * one.y.get(t * H + h);
    ASSERT_NEAR(two.d_topk_weights.get(t * 2), dot, 1e-12);
    ASSERT_NEAR(two.d_topk_weights.get(t * 2 + 1), dot, 1e-12);
  }
}

// I = H, gate = c * Id, up = Id / c, down = Id, x > 0 and c large: silu(c x) ~ c x,
// so a ~ x^2, y ~ (sum_j w_j) x^2 = x^2 and dx ~ 2 x dy.
TEST_F(Identities, IdentityLikeExpertsSquareTheInput) {
  const int64_t H = 128;
  MoeProblem p = make_problem(6, H, H, 4, 2);
  LayerData d = make_data(p, DType::kF64, Routing::kUniform, 23);
  const double c = 40.0;
  d.w13.fill(0.0);
  d.w2.fill(0.0);
  for (int64_t l = 0; l < 4; ++l)
    for (int64_t i = 0; i < H; ++i) {
      d.w13.set((l * 2 * H + i) * H + i, c);
      d.w13.set((l * 2 * H + H + i) * H + i, 1.0 / c);
      d.w2.set((l * H + i) * H + i, 1.0);
    }
  for (int64_t i = 0; i < d.x.view.numel(); ++i) d.x.set(i, 0.5 + 0.25 * (1.0 + d.x.get(i)));
  const LayerOutputs o = run_layer(p, cpu_options(), d);
  for (int64_t i = 0; i < d.x.view.numel(); ++i) {
    const double x = d.x.get(i);
    ASSERT_NEAR(o.y.get(i), x * x, 1e-6 * x * x) << i;
    ASSERT_NEAR(o.dx.get(i), 2 * x * d.dy.get(i), 1e-5) << i;
  }
}

}  // namespace
}  // namespace megamoe::testing
