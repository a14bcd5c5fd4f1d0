#include "testing/random_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "reference/moe_reference.h"
#include "reference/parallel.h"

namespace megamoe::testing {

HostTensor::HostTensor(DType dtype, std::initializer_list<int64_t> shape) {
  view = make_view(nullptr, dtype, shape);
  const int64_t bytes = view.size_bytes();
  storage.assign(static_cast<size_t>((bytes + 7) / 8), 0);
  view.data = storage.empty() ? nullptr : storage.data();
}
HostTensor::HostTensor(HostTensor&& o) noexcept : storage(std::move(o.storage)), view(o.view) {
  view.data = storage.empty() ? nullptr : storage.data();
  o.view = TensorView{};
}
HostTensor& HostTensor::operator=(HostTensor&& o) noexcept {
  storage = std::move(o.storage);
  view = o.view;
  view.data = storage.empty() ? nullptr : storage.data();
  o.view = TensorView{};
  return *this;
}

double HostTensor::get(int64_t i) const {
  if (view.dtype == DType::kI32) return data<int32_t>()[i];
  double v;
  reference::load_elements(view, i, 1, &v);
  return v;
}
void HostTensor::set(int64_t i, double v) {
  if (view.dtype == DType::kI32) {
    data<int32_t>()[i] = static_cast<int32_t>(v);
    return;
  }
  reference::store_elements(view, i, 1, &v, false);
}
std::vector<double> HostTensor::to_f64() const {
  std::vector<double> out(static_cast<size_t>(view.numel()));
  if (view.dtype == DType::kI32) {
    for (size_t i = 0; i < out.size(); ++i) out[i] = data<int32_t>()[i];
  } else {
    reference::load_elements(view, 0, view.numel(), out.data());
  }
  return out;
}
void HostTensor::fill(double v) {
  for (int64_t i = 0; i < view.numel(); ++i) set(i, v);
}

uint64_t hash64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

double uniform_pm1(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t h = hash64(hash64(seed * 0x100000001B3ull + stream) ^ index);
  return static_cast<double>(h >> 11) * 0x1.0p-52 - 1.0;
}

namespace {

void fill_uniform(HostTensor& t, uint64_t seed, uint64_t stream, double scale) {
  const int64_t n = t.view.numel();
  reference::parallel_for(n, reference::resolve_threads(0), [&](int64_t b, int64_t e) {
    std::vector<double> buf(4096);
    for (int64_t i0 = b; i0 < e; i0 += 4096) {
      const int64_t m = std::min<int64_t>(4096, e - i0);
      for (int64_t i = 0; i < m; ++i) buf[i] = scale * uniform_pm1(seed, stream, static_cast<uint64_t>(i0 + i));
      reference::store_elements(t.view, i0, m, buf.data(), false);
    }
  });
}

}  // namespace

LayerData make_layer_data(const LayerSpec& spec) {
  const MoeProblem& p = spec.problem;
  const int64_t T = p.num_tokens, H = p.hidden, I = p.intermediate, L = p.experts_per_rank();
  const int k = p.top_k, E = p.num_experts;
  const DType fd = spec.float_dtype;
  const DType wd = fd == DType::kF64 ? DType::kF64 : DType::kF32;
  const uint64_t seed = hash64(spec.seed) + static_cast<uint64_t>(spec.rank) * 7919u;
  LayerData d;
  d.x = HostTensor(fd, {T, H});
  d.dy = HostTensor(fd, {T, H});
  d.topk_idx = HostTensor(DType::kI32, {T, k});
  d.topk_weights = HostTensor(wd, {T, k});
  d.w13 = HostTensor(fd, {L, 2 * I, H});
  d.w2 = HostTensor(fd, {L, H, I});
  fill_uniform(d.x, seed, 1, 1.0);
  fill_uniform(d.dy, seed, 2, 1.0);
  // Uniform(-a, a) has std a / sqrt(3): rows of w13 give z ~ unit scale.
  fill_uniform(d.w13, seed, 3, std::sqrt(3.0 / static_cast<double>(H)));
  fill_uniform(d.w2, seed, 4, std::sqrt(3.0 / static_cast<double>(I)));

  const int E_used = spec.routing == Routing::kFirstHalf ? std::max(k, E / 2) : E;
  std::vector<int32_t> perm(static_cast<size_t>(E_used));
  int32_t* idx = d.topk_idx.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    uint64_t h = hash64(seed ^ (0xABCDull + static_cast<uint64_t>(t) * 0x9E37ull));
    for (int j = 0; j < k; ++j) {  // partial Fisher-Yates: k distinct experts
      h = hash64(h);
      const int pick = j + static_cast<int>(h % static_cast<uint64_t>(E_used - j));
      std::swap(perm[j], perm[pick]);
    }
    if (spec.routing == Routing::kOneExpert) {
      auto it = std::find(perm.begin(), perm.begin() + k, spec.hot_expert);
      if (it != perm.begin() + k) std::swap(*it, perm[0]);
      else perm[0] = spec.hot_expert;
    }
    double sum = 0.0;
    std::vector<double> w(static_cast<size_t>(k));
    for (int j = 0; j < k; ++j) {
      idx[t * k + j] = perm[j];
      if (spec.routing == Routing::kWithDrops && (hash64(h + static_cast<uint64_t>(j) + 17) & 3) == 0)
        idx[t * k + j] = -1;
      w[j] = 0.25 + 0.75 * (0.5 + 0.5 * uniform_pm1(seed, 5, static_cast<uint64_t>(t * k + j)));
      sum += w[j];
    }
    for (int j = 0; j < k; ++j) d.topk_weights.set(t * k + j, w[j] / sum);
  }
  return d;
}

LayerOutputs make_layer_outputs(const MoeProblem& p, int64_t tokens, DType float_dtype, DType wgrad_dtype,
                                double poison) {
  const int64_t H = p.hidden, I = p.intermediate, L = p.experts_per_rank();
  LayerOutputs o;
  o.y = HostTensor(float_dtype, {tokens, H});
  o.dx = HostTensor(float_dtype, {tokens, H});
  o.d_topk_weights = HostTensor(float_dtype == DType::kF64 ? DType::kF64 : DType::kF32, {tokens, p.top_k});
  o.dw13 = HostTensor(wgrad_dtype, {L, 2 * I, H});
  o.dw2 = HostTensor(wgrad_dtype, {L, H, I});
  for (HostTensor* t : {&o.y, &o.dx, &o.d_topk_weights, &o.dw13, &o.dw2}) t->fill(poison);
  return o;
}

double relative_error(const HostTensor& a, const HostTensor& b) {
  const std::vector<double> va = a.to_f64(), vb = b.to_f64();
  if (va.size() != vb.size()) return std::nan("");
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < va.size(); ++i) {
    const double d = va[i] - vb[i];
    num += d * d;
    den += vb[i] * vb[i];
  }
  if (std::isnan(num)) return num;
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  return a.view.dtype == b.view.dtype && a.view.size_bytes() == b.view.size_bytes() &&
         std::memcmp(a.view.data, b.view.data, static_cast<size_t>(a.view.size_bytes())) == 0;
}

}  // namespace megamoe::testing

namespace megamoe::testing {
TensorView slice0(const TensorView& v, int64_t begin, int64_t count) {
  TensorView s = v;
  int64_t row = dtype_size(v.dtype);
  for (int i = 1; i < v.rank; ++i) row *= v.shape[i];
  s.shape[0] = count;
  s.data = count == 0 ? nullptr : static_cast<char*>(v.data) + begin * row;
  return s;
}
}  // namespace megamoe::testing
