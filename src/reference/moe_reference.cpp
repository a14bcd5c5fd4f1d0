#include "reference/moe_reference.h"

#include <cmath>
#include <cstring>
#include <string>

#include "reference/numerics.h"
#include "reference/parallel.h"

namespace megamoe::reference {

using numerics::ScaleKind;

void load_elements(const TensorView& v, int64_t offset, int64_t count, double* out) {
  switch (v.dtype) {
    case DType::kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(v.data) + offset;
      for (int64_t i = 0; i < count; ++i) out[i] = numerics::float_from_bf16_bits(p[i]);
      return;
    }
    case DType::kF32: {
      const float* p = static_cast<const float*>(v.data) + offset;
      for (int64_t i = 0; i < count; ++i) out[i] = p[i];
      return;
    }
    case DType::kF64:
      std::memcpy(out, static_cast<const double*>(v.data) + offset, static_cast<size_t>(count) * sizeof(double));
      return;
    default:
      for (int64_t i = 0; i < count; ++i) out[i] = std::nan("");
  }
}

void store_elements(const TensorView& v, int64_t offset, int64_t count, const double* in, bool accumulate) {
  switch (v.dtype) {
    case DType::kBF16: {
      uint16_t* p = static_cast<uint16_t*>(v.data) + offset;
      for (int64_t i = 0; i < count; ++i) {
        const double base = accumulate ? numerics::float_from_bf16_bits(p[i]) : 0.0;
        p[i] = numerics::bf16_bits_from_float(static_cast<float>(base + in[i]));
      }
      return;
    }
    case DType::kF32: {
      float* p = static_cast<float*>(v.data) + offset;
      for (int64_t i = 0; i < count; ++i) p[i] = static_cast<float>(accumulate ? p[i] + in[i] : in[i]);
      return;
    }
    case DType::kF64: {
      double* p = static_cast<double*>(v.data) + offset;
      for (int64_t i = 0; i < count; ++i) p[i] = accumulate ? p[i] + in[i] : in[i];
      return;
    }
    default:
      return;
  }
}

namespace {

// Which GEMM operands a pass quantises, and with what tiles. K is the GEMM's
// reduction dimension: activations are tiled along K (1 x g), weights in
// g x g blocks (FP8; the same blocks serve the transposed use) or 1 x g along
// their K (MXFP8, so the backward re-quantises along the other axis), and
// weight-gradient operands, whose K is tokens, in g x 1 (tokens x channel).
struct Recipe {
  bool quantize = false;
  int64_t group = 128;
  bool square_weight_blocks = true;
  ScaleKind scale = ScaleKind::kFloat32;

  static Recipe make(Precision p, bool backward, ScaleMode mode) {
    Recipe r;
    switch (p) {
      case Precision::kBF16: break;
      case Precision::kFP8Bwd: r.quantize = backward; r.scale = numerics::scale_kind(mode); break;
      case Precision::kFP8: r.quantize = true; r.scale = numerics::scale_kind(mode); break;
      case Precision::kMXFP8:
        r.quantize = true;
        r.group = 32;
        r.square_weight_blocks = false;
        r.scale = ScaleKind::kE8M0;
        break;
    }
    return r;
  }
  // [rows, cols] activation, K = cols.
  void activation(std::vector<double>& d, int64_t rows, int64_t cols) const {
    if (quantize) numerics::fake_quantize_e4m3(d.data(), rows, cols, 1, group, scale);
  }
  // [rows, cols] weight used with K = cols (forward) or K = rows (backward).
  void weight(std::vector<double>& d, int64_t rows, int64_t cols, bool k_is_rows) const {
    if (!quantize) return;
    const int64_t tr = square_weight_blocks || k_is_rows ? group : 1;
    const int64_t tc = square_weight_blocks || !k_is_rows ? group : 1;
    numerics::fake_quantize_e4m3(d.data(), rows, cols, tr, tc, scale);
  }
  // [tokens, channels] operand of a weight-gradient GEMM (K = tokens).
  void token_major(std::vector<double>& d, int64_t rows, int64_t cols) const {
    if (quantize) numerics::fake_quantize_e4m3(d.data(), rows, cols, group, 1, scale);
  }
};

double dot_f64(const double* a, const double* b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// fp32 accumulation in a fixed order: 8 interleaved partial sums, then a fixed tree.
float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// C[M, N] = A[M, K] * B[N, K]^T: every GEMM of the layer is this one after a transpose.
std::vector<double> gemm_abt(const std::vector<double>& A, const std::vector<double>& B, int64_t M, int64_t N,
                             int64_t K, bool exact, int threads) {
  std::vector<double> C(static_cast<size_t>(M * N));
  if (exact) {
    parallel_for(M, threads, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m)
        for (int64_t n = 0; n < N; ++n) C[m * N + n] = dot_f64(&A[m * K], &B[n * K], K);
    });
    return C;
  }
  const std::vector<float> Af(A.begin(), A.begin() + M * K), Bf(B.begin(), B.begin() + N * K);
  parallel_for(M, threads, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      for (int64_t n = 0; n < N; ++n) C[m * N + n] = dot_f32(&Af[m * K], &Bf[n * K], K);
  });
  return C;
}

std::vector<double> transpose(const std::vector<double>& a, int64_t rows, int64_t cols) {
  std::vector<double> t(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

// The storage rounding of the emulated mode.
struct Rounder {
  bool exact;
  double bf16(double v) const { return exact ? v : numerics::round_to_bf16(static_cast<float>(v)); }
  double f32(double v) const { return exact ? v : static_cast<double>(static_cast<float>(v)); }
  void bf16(std::vector<double>& v) const {
    if (!exact)
      for (double& x : v) x = numerics::round_to_bf16(static_cast<float>(x));
  }
};

double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

// Everything one call needs, with the problem's sizes spelled out.
struct Layer {
  const MoeProblem& p;
  const Numerics& num;
  int threads;
  int64_t H, I, L;
  int k;
  Rounder rnd;
  Recipe fwd, bwd;

  Layer(const MoeProblem& problem, const Numerics& numerics, int nthreads)
      : p(problem), num(numerics), threads(resolve_threads(nthreads)), H(problem.hidden),
        I(problem.intermediate), L(problem.experts_per_rank()), k(problem.top_k), rnd{numerics.exact},
        fwd(Recipe::make(numerics.precision, false, numerics.scale_mode)),
        bwd(Recipe::make(numerics.precision, true, numerics.scale_mode)) {}

  // Gathers rows [row0, row0 + n) of the pool from the sources' [T, width] tensors.
  std::vector<double> gather(const RankPlan& owner, int64_t row0, int64_t n, int64_t width,
                             const std::vector<TensorView>& src_tensors) const {
    std::vector<double> out(static_cast<size_t>(n * width), 0.0);
    for (int64_t r = 0; r < n; ++r) {
      const RowSource& s = owner.row_source[row0 + r];
      if (s.rank >= 0) load_elements(src_tensors[s.rank], s.token * width, width, &out[r * width]);
    }
    return out;
  }

  std::vector<double> load_expert(const TensorView& w, int64_t l, int64_t rows, int64_t cols) const {
    std::vector<double> out(static_cast<size_t>(rows * cols));
    load_elements(w, l * rows * cols, rows * cols, out.data());
    return out;
  }

  // z = x @ w13^T for one expert's rows, rounded as stored.
  std::vector<double> gemm1(std::vector<double> x, const TensorView& w13, int64_t l, int64_t n) const {
    fwd.activation(x, n, H);
    std::vector<double> w = load_expert(w13, l, 2 * I, H);
    fwd.weight(w, 2 * I, H, /*k_is_rows=*/false);
    std::vector<double> z = gemm_abt(x, w, n, 2 * I, H, num.exact, threads);
    rnd.bf16(z);
    return z;
  }

  std::vector<double> swiglu(const std::vector<double>& z, int64_t n) const {
    std::vector<double> a(static_cast<size_t>(n * I));
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < I; ++i) {
        const double g = z[r * 2 * I + i], u = z[r * 2 * I + I + i];
        a[r * I + i] = rnd.bf16(g * sigmoid(g) * u);
      }
    return a;
  }
};

std::vector<TensorView> field(const std::vector<MoeInputs>& ranks, TensorView MoeInputs::*member) {
  std::vector<TensorView> out;
  for (const MoeInputs& in : ranks) out.push_back(in.*member);
  return out;
}

// Per-source [k, T, width] slot buffers, summed over j in order into [T, width].
struct Slots {
  std::vector<std::vector<double>> data;
  std::vector<int64_t> tokens;
  int k;
  int64_t width;

  Slots(const std::vector<MoeInputs>& ranks, int top_k, int64_t w) : k(top_k), width(w) {
    for (const MoeInputs& in : ranks) {
      tokens.push_back(in.x.shape[0]);
      data.emplace_back(static_cast<size_t>(k * in.x.shape[0] * width), 0.0);
    }
  }
  double* at(const RowSource& s) { return &data[s.rank][(s.slot * tokens[s.rank] + s.token) * width]; }

  void reduce_into(const std::vector<MoeInputs>& ranks, const std::vector<TensorView>& out, const Rounder& rnd) {
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (out[r].data == nullptr) continue;  // caller does not want this output
      const int32_t* idx = static_cast<const int32_t*>(ranks[r].topk_idx.data);
      std::vector<double> sum(static_cast<size_t>(tokens[r] * width));
      for (int64_t t = 0; t < tokens[r]; ++t)
        for (int64_t h = 0; h < width; ++h) {
          double acc = 0.0;
          for (int j = 0; j < k; ++j)
            if (idx[t * k + j] >= 0) acc = rnd.f32(acc + data[r][(j * tokens[r] + t) * width + h]);
          sum[t * width + h] = acc;
        }
      store_elements(out[r], 0, tokens[r] * width, sum.data(), false);
    }
  }
};

double route_weight(const std::vector<MoeInputs>& ranks, const RowSource& s, int k) {
  double w;
  load_elements(ranks[s.rank].topk_weights, s.token * k + s.slot, 1, &w);
  return w;
}

Status build_plan(const MoeProblem& p, const std::vector<MoeInputs>& ranks, RoutingPlan* plan) {
  RoutingShape shape{p.ep_size, p.num_experts, p.top_k, p.token_capacity()};
  std::vector<const int32_t*> idx;
  std::vector<int64_t> tokens;
  for (const MoeInputs& in : ranks) {
    idx.push_back(static_cast<const int32_t*>(in.topk_idx.data));
    tokens.push_back(in.x.shape[0]);
  }
  return build_routing_plan(shape, idx, tokens, plan);
}

}  // namespace

Status run_forward(const MoeProblem& problem, const Numerics& numerics, SavePolicy policy, int threads,
                   const std::vector<MoeInputs>& ranks, const std::vector<TensorView>& y, MoeSaved* saved) {
  auto state = std::make_unique<ReferenceSaved>();
  MEGAMOE_RETURN_IF_ERROR(build_plan(problem, ranks, &state->plan));
  const Layer ly(problem, numerics, threads);
  const int64_t H = ly.H, I = ly.I;
  const bool keep = saved != nullptr && policy == SavePolicy::kKeep;
  Slots slots(ranks, ly.k, H);
  const std::vector<TensorView> xs = field(ranks, &MoeInputs::x);

  for (int d = 0; d < problem.ep_size; ++d) {
    const RankPlan& owner = state->plan.ranks[d];
    if (keep) {
      state->pool_x.emplace_back(static_cast<size_t>(owner.pool_rows() * H), 0.0);
      state->pool_z.emplace_back(static_cast<size_t>(owner.pool_rows() * 2 * I), 0.0);
    }
    for (int64_t l = 0; l < ly.L; ++l) {
      const int64_t row0 = owner.expert_offset[l], n = owner.expert_rows[l];
      if (n == 0) continue;
      std::vector<double> x = ly.gather(owner, row0, n, H, xs);
      if (keep) std::copy(x.begin(), x.end(), state->pool_x[d].begin() + row0 * H);
      std::vector<double> z = ly.gemm1(std::move(x), ranks[d].w13, l, n);
      if (keep) std::copy(z.begin(), z.end(), state->pool_z[d].begin() + row0 * 2 * I);
      std::vector<double> a = ly.swiglu(z, n);
      ly.fwd.activation(a, n, I);
      std::vector<double> w2 = ly.load_expert(ranks[d].w2, l, H, I);
      ly.fwd.weight(w2, H, I, /*k_is_rows=*/false);
      const std::vector<double> o = gemm_abt(a, w2, n, H, I, numerics.exact, ly.threads);
      for (int64_t r = 0; r < n; ++r) {
        const RowSource& s = owner.row_source[row0 + r];
        const double w = route_weight(ranks, s, ly.k);
        double* slot = slots.at(s);
        for (int64_t h = 0; h < H; ++h) slot[h] = ly.rnd.bf16(ly.rnd.f32(w * o[r * H + h]));
      }
    }
  }
  slots.reduce_into(ranks, y, ly.rnd);

  if (saved != nullptr) {
    state->problem = problem;
    state->numerics = numerics;
    state->policy = policy;
    saved->reset(std::move(state));
  }
  return Status::Ok();
}

Status run_backward(const MoeProblem& problem, const Numerics& numerics, int threads,
                    const std::vector<MoeInputs>& ranks, const std::vector<TensorView>& dy, const MoeSaved& saved,
                    const std::vector<MoeGrads>& grads, bool accumulate_weight_grads) {
  const auto* state = dynamic_cast<const ReferenceSaved*>(saved.impl());
  if (state == nullptr) return invalid_argument("saved: not produced by a CPU-reference forward");
  const Layer ly(problem, numerics, threads);
  const int64_t H = ly.H, I = ly.I;
  const int k = ly.k;
  const bool keep = state->policy == SavePolicy::kKeep;
  Slots dx_slots(ranks, k, H);
  std::vector<std::vector<double>> dw_route;  // per source [T, k]
  for (const MoeInputs& in : ranks) dw_route.emplace_back(static_cast<size_t>(in.x.shape[0] * k), 0.0);
  const std::vector<TensorView> xs = field(ranks, &MoeInputs::x);

  for (int d = 0; d < problem.ep_size; ++d) {
    const RankPlan& owner = state->plan.ranks[d];
    for (int64_t l = 0; l < ly.L; ++l) {
      const int64_t row0 = owner.expert_offset[l], n = owner.expert_rows[l];
      // A null dw13 means the caller wants no weight gradients from this rank.
      const bool want_wgrad = grads[d].dw13.data != nullptr && grads[d].dw2.data != nullptr;
      if (n == 0) {
        if (want_wgrad && !accumulate_weight_grads) {
          const std::vector<double> zeros13(static_cast<size_t>(2 * I * H), 0.0);
          store_elements(grads[d].dw13, l * 2 * I * H, 2 * I * H, zeros13.data(), false);
          store_elements(grads[d].dw2, l * H * I, H * I, zeros13.data(), false);
        }
        continue;
      }
      std::vector<double> x = keep ? std::vector<double>(state->pool_x[d].begin() + row0 * H,
                                                         state->pool_x[d].begin() + (row0 + n) * H)
                                   : ly.gather(owner, row0, n, H, xs);
      const std::vector<double> z =
          keep ? std::vector<double>(state->pool_z[d].begin() + row0 * 2 * I,
                                     state->pool_z[d].begin() + (row0 + n) * 2 * I)
               : ly.gemm1(x, ranks[d].w13, l, n);
      const std::vector<double> a = ly.swiglu(z, n);
      const std::vector<double> dyp = ly.gather(owner, row0, n, H, dy);

      // ga = dy @ w2 (K = H: w2's rows)
      std::vector<double> dyq = dyp;
      ly.bwd.activation(dyq, n, H);
      std::vector<double> w2 = ly.load_expert(ranks[d].w2, l, H, I);
      ly.bwd.weight(w2, H, I, /*k_is_rows=*/true);
      const std::vector<double> ga = gemm_abt(dyq, transpose(w2, H, I), n, I, H, numerics.exact, ly.threads);

      // Routing-weight gradient and SwiGLU backward, row by row.
      std::vector<double> dz(static_cast<size_t>(n * 2 * I)), wa(static_cast<size_t>(n * I));
      for (int64_t r = 0; r < n; ++r) {
        const RowSource& s = owner.row_source[row0 + r];
        const double w = route_weight(ranks, s, k);
        if (numerics.exact) {
          dw_route[s.rank][s.token * k + s.slot] = dot_f64(&ga[r * I], &a[r * I], I);
        } else {
          const std::vector<float> gf(ga.begin() + r * I, ga.begin() + (r + 1) * I);
          const std::vector<float> af(a.begin() + r * I, a.begin() + (r + 1) * I);
          dw_route[s.rank][s.token * k + s.slot] = dot_f32(gf.data(), af.data(), I);
        }
        for (int64_t i = 0; i < I; ++i) {
          const double g = z[r * 2 * I + i], u = z[r * 2 * I + I + i];
          const double sg = sigmoid(g), silu = g * sg, dsilu = sg * (1.0 + g * (1.0 - sg));
          const double da = ly.rnd.f32(w * ga[r * I + i]);
          dz[r * 2 * I + i] = ly.rnd.bf16(da * u * dsilu);
          dz[r * 2 * I + I + i] = ly.rnd.bf16(da * silu);
        }
        for (int64_t i = 0; i < I; ++i) wa[r * I + i] = ly.rnd.bf16(ly.rnd.f32(w * a[r * I + i]));
      }

      // dx slots = dz @ w13 (K = 2I: w13's rows)
      std::vector<double> dzq = dz;
      ly.bwd.activation(dzq, n, 2 * I);
      std::vector<double> w13 = ly.load_expert(ranks[d].w13, l, 2 * I, H);
      ly.bwd.weight(w13, 2 * I, H, /*k_is_rows=*/true);
      const std::vector<double> dxs = gemm_abt(dzq, transpose(w13, 2 * I, H), n, H, 2 * I, numerics.exact, ly.threads);
      for (int64_t r = 0; r < n; ++r) {
        double* slot = dx_slots.at(owner.row_source[row0 + r]);
        for (int64_t h = 0; h < H; ++h) slot[h] = ly.rnd.bf16(dxs[r * H + h]);
      }

      // Weight gradients: K-grouped over this expert's rows (K = tokens).
      if (!want_wgrad) continue;
      // dW2 = sum_rows dy (w a)^T: the routing weight rides on the narrower operand.
      std::vector<double> dyw = dyp;
      ly.bwd.token_major(dyw, n, H);
      ly.bwd.token_major(wa, n, I);
      const std::vector<double> dw2 =
          gemm_abt(transpose(dyw, n, H), transpose(wa, n, I), H, I, n, numerics.exact, ly.threads);
      ly.bwd.token_major(dz, n, 2 * I);
      ly.bwd.token_major(x, n, H);
      const std::vector<double> dw13 =
          gemm_abt(transpose(dz, n, 2 * I), transpose(x, n, H), 2 * I, H, n, numerics.exact, ly.threads);
      store_elements(grads[d].dw2, l * H * I, H * I, dw2.data(), accumulate_weight_grads);
      store_elements(grads[d].dw13, l * 2 * I * H, 2 * I * H, dw13.data(), accumulate_weight_grads);
    }
  }
  std::vector<TensorView> dxs;
  for (const MoeGrads& g : grads) dxs.push_back(g.dx);
  dx_slots.reduce_into(ranks, dxs, ly.rnd);
  for (size_t r = 0; r < ranks.size(); ++r)
    if (grads[r].d_topk_weights.data != nullptr)
      store_elements(grads[r].d_topk_weights, 0, static_cast<int64_t>(dw_route[r].size()), dw_route[r].data(), false);
  return Status::Ok();
}

}  // namespace megamoe::reference
