// Owned host tensors and seeded random MoE inputs, shared by the CLI, the
// benchmarks and the tests. Values are counter-based hashes of (seed, tensor,
// element), so they do not depend on thread count or fill order.
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/moe.h"

namespace megamoe::testing {

struct HostTensor {
  std::vector<uint64_t> storage;  // 8-byte aligned backing store
  TensorView view;

  HostTensor() = default;
  HostTensor(DType dtype, std::initializer_list<int64_t> shape);
  HostTensor(const HostTensor&) = delete;
  HostTensor& operator=(const HostTensor&) = delete;
  HostTensor(HostTensor&& o) noexcept;
  HostTensor& operator=(HostTensor&& o) noexcept;

  template <typename T>
  T* data() const { return static_cast<T*>(view.data); }
  double get(int64_t i) const;  // element i as double (any dtype)
  void set(int64_t i, double v);
  std::vector<double> to_f64() const;
  void fill(double v);
};

enum class Routing {
  kUniform,      // k distinct experts per token, uniformly
  kOneExpert,    // every token's slot 0 goes to expert `hot_expert`, others uniform
  kWithDrops,    // uniform, then each route is -1 with probability 1/4
  kFirstHalf,    // only the first half of the experts receive tokens (the rest are empty)
};

struct LayerSpec {
  MoeProblem problem;            // shapes; num_tokens per rank
  DType float_dtype = DType::kBF16;  // bf16 or f64 for x, w13, w2, dy (weights f32|f64)
  Routing routing = Routing::kUniform;
  int hot_expert = 0;
  uint64_t seed = 1;
  int rank = 0;                  // rank whose tokens and local experts these are
};

// One rank's inputs (and an upstream gradient dy), with moderately scaled
// values: x, dy ~ U(-1, 1); w13 rows ~ 1/sqrt(H), w2 ~ 1/sqrt(I); topk
// weights positive and summing to 1 per token.
struct LayerData {
  HostTensor x, topk_idx, topk_weights, w13, w2, dy;
  MoeInputs inputs() const { return {x.view, topk_idx.view, topk_weights.view, w13.view, w2.view}; }
};
LayerData make_layer_data(const LayerSpec& spec);

// Output tensors of one rank: y [T,H]; dx; d_topk_w; dw13; dw2 (dtype of the weight grads given).
struct LayerOutputs {
  HostTensor y, dx, d_topk_weights, dw13, dw2;
  MoeGrads grads() const { return {dx.view, d_topk_weights.view, dw13.view, dw2.view}; }
};
LayerOutputs make_layer_outputs(const MoeProblem& p, int64_t tokens, DType float_dtype, DType wgrad_dtype,
                                double poison);

// ||a - b|| / ||b|| over all elements (NaN if any element is NaN).
double relative_error(const HostTensor& a, const HostTensor& b);
bool bitwise_equal(const HostTensor& a, const HostTensor& b);

uint64_t hash64(uint64_t x);

// A small deterministic generator (splitmix64): results do not depend on the
// standard library's distributions.
struct SeededRng {
  uint64_t state;
  explicit SeededRng(uint64_t seed) : state(seed) {}
  uint64_t next() { return hash64(state++ * 0x9E3779B97F4A7C15ull); }
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }          // [0, 1)
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }  // [0, n)
  int between(int lo, int hi) { return lo + below(hi - lo + 1); }                    // [lo, hi]
};
// Uniform in [-1, 1) from (seed, stream, index).
double uniform_pm1(uint64_t seed, uint64_t stream, uint64_t index);

}  // namespace megamoe::testing

namespace megamoe::testing {
// Rows [begin, begin + count) of dimension 0 of a view (no copy).
TensorView slice0(const TensorView& v, int64_t begin, int64_t count);
}  // namespace megamoe::testing
