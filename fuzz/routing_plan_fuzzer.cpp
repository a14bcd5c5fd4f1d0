// libFuzzer target for the routing plan. The input bytes pick a shape
// (possibly invalid), per-rank token counts (possibly beyond
// max_tokens_per_rank) and topk_idx values (possibly out of range or
// duplicated). A rejected routing is fine; an accepted one must satisfy every
// plan invariant, and nothing may crash (ASan/UBSan watch the library too).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/routing_plan.h"

namespace {

// Reads the input front to back; past the end it yields zeros.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  int in(int lo, int hi) { return lo + u8() % (hi - lo + 1); }  // [lo, hi]

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using megamoe::RoutingShape;
  Bytes in(data, size);

  // Flags: which kinds of invalid input this run may contain.
  const uint8_t flags = in.u8();
  const bool raw_ids = flags & 1;        // ids taken as they come: duplicates allowed
  const bool bad_ids = flags & 2;        // some ids outside [-1, E)
  const bool free_shape = flags & 4;     // E and k not forced valid
  const bool bad_rank_count = (flags & 0x38) == 0x38;  // vectors of the wrong length
  const bool null_ranks = flags & 0x40;  // nullptr topk_idx for ranks without tokens

  RoutingShape shape;
  shape.num_ranks = in.in(1, 8);
  if (free_shape) {
    shape.num_experts = in.in(0, 64);
    shape.top_k = in.in(0, 10);
    if (in.u8() == 0xFF) shape.num_ranks = 0;
  } else {
    shape.num_experts = shape.num_ranks * in.in(1, 64 / shape.num_ranks);
    shape.top_k = in.in(1, shape.num_experts < 8 ? shape.num_experts : 8);
  }
  shape.max_tokens_per_rank = in.in(0, 64);
  const int P = shape.num_ranks, E = shape.num_experts, k = shape.top_k;

  std::vector<int64_t> tokens(static_cast<size_t>(P));
  for (int64_t& t : tokens) t = in.in(0, static_cast<int>(shape.max_tokens_per_rank) + ((flags & 0x80) ? 2 : 0));

  std::vector<std::vector<int32_t>> idx(static_cast<size_t>(P));
  const int kk = k > 0 ? k : 0;
  for (int r = 0; r < P; ++r) {
    idx[r].assign(static_cast<size_t>(tokens[r] * kk), -1);
    for (int64_t t = 0; t < tokens[r]; ++t) {
      int32_t* row = idx[r].data() + t * kk;
      for (int j = 0; j < kk; ++j) {
        const uint8_t b = in.u8();
        int32_t e = static_cast<int32_t>(b % (E + 1)) - 1;  // [-1, E)
        if (bad_ids && b >= 0xF0) {
          const int32_t odd[] = {E, E + 1, -2, INT32_MIN, INT32_MAX, 1 << 20};
          e = odd[b % 6];
        }
        if (!raw_ids && e >= 0)
          for (int j2 = 0; j2 < j; ++j2)
            if (row[j2] == e) e = -1;  // keep the routing duplicate-free
        row[j] = e;
      }
    }
  }

  std::vector<const int32_t*> ptrs;
  for (int r = 0; r < P; ++r) ptrs.push_back(null_ranks && idx[r].empty() ? nullptr : idx[r].data());
  if (bad_rank_count) {
    if (in.u8() & 1) ptrs.push_back(nullptr);
    else tokens.push_back(0);
  }

  megamoe::RoutingPlan plan;
  const megamoe::Status st = megamoe::build_routing_plan(shape, ptrs, tokens, &plan);
  if (!st.ok()) {
    if (st.message().empty()) __builtin_trap();  // a rejection must say why
    return 0;
  }
  // Vectors of the wrong length must never be accepted; every accepted plan
  // must hold every invariant and fit the worst-case pool.
  if (bad_rank_count) __builtin_trap();
  if (!megamoe::check_plan_invariants(plan, ptrs, tokens).ok()) __builtin_trap();
  for (int d = 0; d < P; ++d)
    if (plan.ranks[d].pool_rows() > megamoe::pool_capacity_rows(shape)) __builtin_trap();
  return 0;
}
