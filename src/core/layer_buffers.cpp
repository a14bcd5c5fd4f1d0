#include "core/layer_buffers.h"

#include <algorithm>
#include <limits>
#include <string>

namespace megamoe {
namespace {

// Appends regions with checked arithmetic.
class Carver {
 public:
  Region take(int64_t count, size_t elem) {
    Region r;
    if (!ok_) return r;
    const size_t aligned = (offset_ + kBufferAlign - 1) / kBufferAlign * kBufferAlign;
    size_t bytes = 0;
    if (count < 0 || __builtin_mul_overflow(static_cast<size_t>(count), elem, &bytes) ||
        __builtin_add_overflow(aligned, bytes, &offset_) || offset_ > kMaxBytes) {
      ok_ = false;
      return r;
    }
    r.offset = aligned;
    r.bytes = bytes;
    return r;
  }
  size_t end() const { return (offset_ + kBufferAlign - 1) / kBufferAlign * kBufferAlign; }
  bool ok() const { return ok_; }
  void set_offset(size_t o) { offset_ = o; }

 private:
  static constexpr size_t kMaxBytes = size_t{1} << 56;
  size_t offset_ = 0;
  bool ok_ = true;
};

Status too_large(const LayerDims& d) {
  return capacity_error("buffers for num_tokens = " + std::to_string(d.tokens) + " (hidden " +
                        std::to_string(d.hidden) + ", intermediate " + std::to_string(d.intermediate) + ", " +
                        std::to_string(d.num_experts) + " experts, top_k " + std::to_string(d.top_k) +
                        ") exceed what one device can address");
}

void carve_saved(Carver& c, const LayerDims& d, int64_t C, SavedLayout* s) {
  s->error_key = c.take(1, 8);
  s->expert_rows = c.take(d.num_experts, 4);
  s->expert_offset = c.take(int64_t{d.num_experts} + 1, 4);
  s->tile_expert = c.take(C / 128, 4);
  int64_t routes = 0;
  if (__builtin_mul_overflow(d.tokens, int64_t{d.top_k}, &routes)) routes = -1;
  s->route_row = c.take(routes, 4);
  s->row_src = c.take(C, 4);
  int64_t zcols = 0, zelems = 0;
  if (__builtin_mul_overflow(d.intermediate, int64_t{2}, &zcols) || __builtin_mul_overflow(C, zcols, &zelems))
    zelems = -1;
  s->z_pool = c.take(zelems, 2);
}

int64_t product(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? -1 : r;
}

}  // namespace

Status pool_capacity(const LayerDims& d, int64_t* rows) {
  if (d.tokens < 0 || d.hidden <= 0 || d.intermediate <= 0 || d.num_experts <= 0 || d.top_k <= 0)
    return invalid_argument("layer dims: tokens >= 0 and positive hidden, intermediate, num_experts, top_k expected");
  const int64_t per_token = d.top_k < d.num_experts ? d.top_k : d.num_experts;
  int64_t routes = 0, c = 0;
  if (__builtin_mul_overflow(d.tokens, per_token, &routes) ||
      __builtin_add_overflow(routes, int64_t{d.num_experts} * 127 + 127, &c))
    return too_large(d);
  c = c / 128 * 128;
  if (c > std::numeric_limits<int32_t>::max() / 2) return too_large(d);  // pool rows are int32 on the device
  *rows = c;
  return Status::Ok();
}

Status saved_layout(const LayerDims& d, SavedLayout* out) {
  int64_t C = 0;
  MEGAMOE_RETURN_IF_ERROR(pool_capacity(d, &C));
  Carver c;
  carve_saved(c, d, C, out);
  if (!c.ok()) return too_large(d);
  out->bytes = c.end();
  return Status::Ok();
}

Status scratch_layout(const LayerDims& d, bool holds_plan, ScratchLayout* out, bool ep_owner) {
  int64_t C = 0;
  MEGAMOE_RETURN_IF_ERROR(pool_capacity(d, &C));
  Carver c;
  out->chunk_counts = c.take(product((d.tokens + kPlanChunk - 1) / kPlanChunk, d.num_experts), 4);
  out->holds_plan = holds_plan;
  if (holds_plan) {
    MEGAMOE_RETURN_IF_ERROR(saved_layout(d, &out->plan));
    out->plan_offset = c.take(1, 1).offset;
    c.set_offset(out->plan_offset + out->plan.bytes);
  }
  const bool fwd8 = d.precision == Precision::kFP8;
  out->hidden_pool = c.take(fwd8 && !ep_owner ? 0 : product(C, d.hidden), 2);
  out->a_pool = c.take(product(C, d.intermediate), 2);
  out->dz_pool = c.take(product(C, product(d.intermediate, 2)), 2);
  out->dw_partial = c.take(product(C, d.intermediate / 128), 4);
  const bool bwd8 = fwd8 || d.precision == Precision::kFP8Bwd;
  const int64_t H = d.hidden, I2 = product(d.intermediate, 2);
  auto rows_q = [&](Region* q, Region* s, int64_t cols, bool use) {  // 1 x 128 row tiles of a pool
    *q = c.take(use ? product(C, cols) : 0, 1);
    *s = c.take(use ? product(C, cols / 128) : 0, 4);
  };
  auto cols_t = [&](Region* q, Region* s, int64_t cols) {  // 128 x 1 tiles, transposed
    *q = c.take(bwd8 ? product(cols, C) : 0, 1);
    *s = c.take(bwd8 ? product(C / 128, cols) : 0, 4);
  };
  // Four sets, each dead before the next is written (one call runs on one
  // stream): the forward's (or the backward's recomputed GEMM1's), the data
  // gradients', dW2's, dW13's. They share one area, each set from its start.
  Fp8Layout& f = out->fp8;
  const size_t fp8_base = c.end();
  size_t fp8_end = fp8_base;
  auto set = [&](auto&& carve_set) {
    c.set_offset(fp8_base);
    carve_set();
    fp8_end = std::max(fp8_end, c.end());
  };
  set([&] {
    rows_q(&f.x_q, &f.x_s, H, fwd8);
    rows_q(&f.a_q, &f.a_s, d.intermediate, fwd8);
  });
  set([&] {
    rows_q(&f.dy_q, &f.dy_s, H, bwd8);
    rows_q(&f.dz_q, &f.dz_s, I2, bwd8);
  });
  set([&] {
    cols_t(&f.dy_t, &f.dy_ts, H);
    cols_t(&f.wa_t, &f.wa_ts, d.intermediate);
  });
  set([&] {
    cols_t(&f.dz_t, &f.dz_ts, I2);
    cols_t(&f.x_t, &f.x_ts, H);
  });
  c.set_offset(fp8_end);
  out->slots = c.take(product(product(d.top_k, d.tokens), d.hidden), 2);
  if (!c.ok()) return too_large(d);
  out->bytes = c.end();
  out->bytes_without_slots = out->slots.offset;
  return Status::Ok();
}

Status fp8_weight_layout(const LayerDims& d, Fp8WeightLayout* out) {
  *out = Fp8WeightLayout{};
  const bool fwd8 = d.precision == Precision::kFP8;
  if (!fwd8 && d.precision != Precision::kFP8Bwd) return Status::Ok();
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts;
  const int64_t w13 = product(E, product(product(I, 2), H)), w2 = product(E, product(H, I));
  Carver c;
  out->w13_s = c.take(product(E, product(product(I, 2) / 128, H / 128)), 4);
  out->w2_s = c.take(product(E, product(H / 128, I / 128)), 4);
  out->w13_q = c.take(fwd8 ? w13 : 0, 1);
  out->w2_q = c.take(fwd8 ? w2 : 0, 1);
  out->w13_t = c.take(w13, 1);
  out->w2_t = c.take(w2, 1);
  if (!c.ok())
    return capacity_error("fp8 weights of " + std::to_string(E) + " experts (hidden " + std::to_string(H) +
                          ", intermediate " + std::to_string(I) + ") exceed what one device can address");
  out->bytes = c.end();
  return Status::Ok();
}

}  // namespace megamoe
