// The byte layouts of the CUDA layer's buffers (core/layer_buffers.h): pure
// arithmetic, so checked here without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/layer_buffers.h"

namespace megamoe {
namespace {

LayerDims qwen3_30b(int64_t tokens) { return LayerDims{tokens, 2048, 768, 128, 8}; }

void expect_disjoint_and_aligned(std::vector<Region> regions, size_t total) {
  std::sort(regions.begin(), regions.end(), [](const Region& a, const Region& b) { return a.offset < b.offset; });
  for (size_t i = 0; i < regions.size(); ++i) {
    EXPECT_EQ(regions[i].offset % kBufferAlign, 0u);
    EXPECT_LE(regions[i].offset + regions[i].bytes, total);
    if (i > 0) {
      EXPECT_LE(regions[i - 1].offset + regions[i - 1].bytes, regions[i].offset) << "overlap at " << i;
    }
  }
}

TEST(LayerBuffers, CapacityIsTheWorstCasePool) {
  int64_t c = 0;
  ASSERT_TRUE(pool_capacity(qwen3_30b(8192), &c).ok());
  EXPECT_EQ(c, (8192 * 8 + 127 * 128 + 127) / 128 * 128);
  ASSERT_TRUE(pool_capacity(LayerDims{10, 128, 128, 4, 8}, &c).ok());  // k > E: a token meets each expert once
  EXPECT_EQ(c, (10 * 4 + 127 * 4 + 127) / 128 * 128);
  ASSERT_TRUE(pool_capacity(LayerDims{0, 128, 128, 4, 2}, &c).ok());
  EXPECT_EQ(c, 512);
}

TEST(LayerBuffers, SavedHoldsPlanAndZ) {
  SavedLayout s;
  ASSERT_TRUE(saved_layout(qwen3_30b(8192), &s).ok());
  int64_t c = 0;
  ASSERT_TRUE(pool_capacity(qwen3_30b(8192), &c).ok());
  EXPECT_EQ(s.z_pool.bytes, static_cast<size_t>(c) * 2 * 768 * 2);
  EXPECT_EQ(s.route_row.bytes, 8192u * 8 * 4);
  EXPECT_EQ(s.bytes % kBufferAlign, 0u);
  expect_disjoint_and_aligned({s.error_key, s.expert_rows, s.expert_offset, s.tile_expert, s.route_row, s.row_src,
                               s.z_pool},
                              s.bytes);
}

TEST(LayerBuffers, ScratchWithAndWithoutThePlan) {
  ScratchLayout with, without;
  ASSERT_TRUE(scratch_layout(qwen3_30b(4096), true, &with).ok());
  ASSERT_TRUE(scratch_layout(qwen3_30b(4096), false, &without).ok());
  SavedLayout s;
  ASSERT_TRUE(saved_layout(qwen3_30b(4096), &s).ok());
  EXPECT_GE(with.bytes, without.bytes + s.bytes);
  expect_disjoint_and_aligned({without.chunk_counts, without.hidden_pool, without.a_pool, without.slots, without.dz_pool,
                               without.dw_partial},
                              without.bytes);
  expect_disjoint_and_aligned({with.chunk_counts, Region{with.plan_offset, with.plan.bytes}, with.hidden_pool, with.a_pool,
                               with.slots, with.dz_pool, with.dw_partial},
                              with.bytes);
  EXPECT_EQ(without.slots.bytes, 8u * 4096 * 2048 * 2);
}

// An expert-parallel owner allocates everything but the slots (its GEMMs write
// those rows into the sources' return areas): they must be the tail.
TEST(LayerBuffers, SlotsAreTheTailAnEpOwnerLeavesOut) {
  for (bool plan : {false, true}) {
    ScratchLayout sl;
    ASSERT_TRUE(scratch_layout(qwen3_30b(4096), plan, &sl).ok());
    EXPECT_EQ(sl.bytes_without_slots, sl.slots.offset);
    EXPECT_GE(sl.bytes - sl.bytes_without_slots, sl.slots.bytes);
    for (const Region& r : {sl.chunk_counts, sl.hidden_pool, sl.a_pool, sl.dz_pool, sl.dw_partial})
      EXPECT_LE(r.offset + r.bytes, sl.bytes_without_slots);
    if (plan) {
      EXPECT_LE(sl.plan_offset + sl.plan.bytes, sl.bytes_without_slots);
    }
  }
}

// FP8's operand regions: none for bf16, the backward's only for fp8_bwd, all
// for fp8; each as large as what its quantizer writes; slots stay the tail.
TEST(LayerBuffers, Fp8OperandRegionsByPrecision) {
  const LayerDims bf = qwen3_30b(4096);
  LayerDims f8 = bf, f8b = bf;
  f8.precision = Precision::kFP8, f8b.precision = Precision::kFP8Bwd;
  ScratchLayout s16, s8, s8b;
  ASSERT_TRUE(scratch_layout(bf, false, &s16).ok());
  ASSERT_TRUE(scratch_layout(f8, false, &s8).ok());
  ASSERT_TRUE(scratch_layout(f8b, false, &s8b).ok());
  int64_t C = 0;
  ASSERT_TRUE(pool_capacity(bf, &C).ok());
  const int64_t H = 2048, I = 768;
  auto regions = [](const Fp8Layout& f) {
    return std::vector<Region>{f.x_q,  f.x_s,   f.a_q,  f.a_s,   f.dy_q, f.dy_s, f.dz_q, f.dz_s,
                               f.dy_t, f.dy_ts, f.wa_t, f.wa_ts, f.dz_t, f.dz_ts, f.x_t, f.x_ts};
  };
  for (const Region& r : regions(s16.fp8)) EXPECT_EQ(r.bytes, 0u);
  // fp8: every region, sized as its writer fills it.
  const Fp8Layout& f = s8.fp8;
  EXPECT_EQ(f.x_q.bytes, static_cast<size_t>(C * H));
  EXPECT_EQ(f.x_s.bytes, static_cast<size_t>(C * (H / 128) * 4));
  EXPECT_EQ(f.a_q.bytes, static_cast<size_t>(C * I));
  EXPECT_EQ(f.dz_q.bytes, static_cast<size_t>(C * 2 * I));
  EXPECT_EQ(f.dz_t.bytes, static_cast<size_t>(2 * I * C));
  EXPECT_EQ(f.dz_ts.bytes, static_cast<size_t>((C / 128) * 2 * I * 4));
  EXPECT_EQ(f.wa_ts.bytes, static_cast<size_t>((C / 128) * I * 4));
  // fp8_bwd: the forward's activation regions are empty, the backward's are there.
  EXPECT_EQ(s8b.fp8.x_q.bytes, 0u);
  EXPECT_EQ(s8b.fp8.a_q.bytes, 0u);
  EXPECT_EQ(s8b.fp8.dy_q.bytes, f.dy_q.bytes);
  EXPECT_EQ(s8b.fp8.x_t.bytes, f.x_t.bytes);
  // The bf16 x/dy pool: none for the one-GPU fp8 layer (its e4m3 operands come
  // from the token rows), there for bf16, fp8_bwd (bf16 forward) and an
  // expert-parallel owner in fp8 (its pool receives rows).
  ScratchLayout s8_owner;
  ASSERT_TRUE(scratch_layout(f8, false, &s8_owner, true).ok());
  const size_t pool_bytes = static_cast<size_t>(C * H * 2);
  EXPECT_EQ(s16.hidden_pool.bytes, pool_bytes);
  EXPECT_EQ(s8.hidden_pool.bytes, 0u);
  EXPECT_EQ(s8b.hidden_pool.bytes, pool_bytes);
  EXPECT_EQ(s8_owner.hidden_pool.bytes, pool_bytes);
  EXPECT_EQ(s8_owner.bytes, s8.bytes + pool_bytes);
  // The four sets (GEMM1/2, data gradients, dW2, dW13): each set's regions
  // are disjoint and clear of everything that is not FP8; the sets share one
  // area from one offset, as large as the largest set. For fp8 and fp8_bwd,
  // with the plan in scratch (recompute) or not.
  for (const Precision p : {Precision::kFP8, Precision::kFP8Bwd})
    for (const bool holds_plan : {false, true}) {
      LayerDims dp = bf;
      dp.precision = p;
      ScratchLayout s, s_bf16;
      ASSERT_TRUE(scratch_layout(dp, holds_plan, &s).ok());
      ASSERT_TRUE(scratch_layout(bf, holds_plan, &s_bf16).ok());
      const Fp8Layout& g = s.fp8;
      const std::vector<std::vector<Region>> sets = {{g.x_q, g.x_s, g.a_q, g.a_s},
                                                     {g.dy_q, g.dy_s, g.dz_q, g.dz_s},
                                                     {g.dy_t, g.dy_ts, g.wa_t, g.wa_ts},
                                                     {g.dz_t, g.dz_ts, g.x_t, g.x_ts}};
      size_t largest = 0;
      for (const auto& set : sets) {
        std::vector<Region> all = {s.chunk_counts, s.a_pool, s.dz_pool, s.dw_partial, s.slots};
        if (s.hidden_pool.bytes > 0) all.push_back(s.hidden_pool);
        if (holds_plan) all.push_back(Region{s.plan_offset, s.plan.bytes});
        for (const Region& r : set)
          if (r.bytes > 0) all.push_back(r);
        expect_disjoint_and_aligned(all, s.bytes);
        EXPECT_EQ(set.front().offset, g.x_q.offset) << "every set starts where the first does";
        largest = std::max(largest, set.back().offset + set.back().bytes - set.front().offset);
      }
      for (const Region& r : regions(g)) EXPECT_LE(r.offset + r.bytes, s.bytes_without_slots);
      // The area is the largest set (no more, up to alignment): the data gradients' (= dW13's) here;
      // fp8 has no bf16 x/dy pool.
      const size_t grown = s.bytes + (s_bf16.hidden_pool.bytes - s.hidden_pool.bytes) - s_bf16.bytes;
      EXPECT_LE(grown, largest + 4 * kBufferAlign);
      EXPECT_GE(grown, largest);
    }
  // fp8_bwd needs the same area (the backward's sets are the largest) and the bf16 pool fp8 does without.
  EXPECT_EQ(s8.bytes + pool_bytes, s8b.bytes);
  EXPECT_GT(s8b.bytes, s16.bytes);
}

TEST(LayerBuffers, Fp8WeightsHoldWhatEachPrecisionReads) {
  LayerDims d;
  d.tokens = 4096, d.hidden = 2048, d.intermediate = 768, d.num_experts = 128, d.top_k = 8;
  const size_t H = 2048, I = 768, E = 128;
  Fp8WeightLayout w;
  ASSERT_TRUE(fp8_weight_layout(d, &w).ok());
  EXPECT_EQ(w.bytes, 0u);  // bf16: none
  d.precision = Precision::kFP8;
  ASSERT_TRUE(fp8_weight_layout(d, &w).ok());
  EXPECT_EQ(w.w13_q.bytes, E * 2 * I * H);
  EXPECT_EQ(w.w13_t.bytes, w.w13_q.bytes);
  EXPECT_EQ(w.w13_s.bytes, E * (2 * I / 128) * (H / 128) * 4);
  EXPECT_EQ(w.w2_q.bytes, E * H * I);
  EXPECT_EQ(w.w2_t.bytes, E * H * I);
  EXPECT_EQ(w.w2_s.bytes, E * (H / 128) * (I / 128) * 4);
  expect_disjoint_and_aligned({w.w13_s, w.w2_s, w.w13_q, w.w2_q, w.w13_t, w.w2_t}, w.bytes);
  const size_t fp8_bytes = w.bytes;
  // fp8_bwd: the forward is bf16, so only the transposed copies and the scales.
  d.precision = Precision::kFP8Bwd;
  ASSERT_TRUE(fp8_weight_layout(d, &w).ok());
  EXPECT_EQ(w.w13_q.bytes, 0u);
  EXPECT_EQ(w.w2_q.bytes, 0u);
  EXPECT_EQ(w.w13_t.bytes, E * 2 * I * H);
  EXPECT_LT(w.bytes, fp8_bytes);
  // no dependence on the token count
  d.tokens = 1;
  Fp8WeightLayout w1;
  ASSERT_TRUE(fp8_weight_layout(d, &w1).ok());
  EXPECT_EQ(w1.bytes, w.bytes);
  // overflow is a Capacity error, not a wrap
  d.num_experts = 1 << 30, d.hidden = int64_t{1} << 40;
  EXPECT_EQ(fp8_weight_layout(d, &w).code(), StatusCode::kCapacity);
}

TEST(LayerBuffers, GrowWithTokens) {
  size_t last_saved = 0, last_scratch = 0;
  for (int64_t t : {1, 100, 256, 257, 4096, 16384}) {
    SavedLayout s;
    ScratchLayout sl;
    ASSERT_TRUE(saved_layout(qwen3_30b(t), &s).ok());
    ASSERT_TRUE(scratch_layout(qwen3_30b(t), false, &sl).ok());
    EXPECT_GT(s.bytes, last_saved);
    EXPECT_GT(sl.bytes, last_scratch);
    last_saved = s.bytes, last_scratch = sl.bytes;
  }
}

TEST(LayerBuffers, OverflowIsACapacityErrorNotAWrap) {
  for (int64_t t : {int64_t{1} << 62, int64_t{9223372036854775807}, int64_t{536870912}, int64_t{1} << 40}) {
    SavedLayout s;
    ScratchLayout sl;
    const Status a = saved_layout(qwen3_30b(t), &s), b = scratch_layout(qwen3_30b(t), true, &sl);
    EXPECT_EQ(a.code(), StatusCode::kCapacity) << t;
    EXPECT_EQ(b.code(), StatusCode::kCapacity) << t;
    EXPECT_NE(a.message().find("exceed what one device can address"), std::string::npos) << a.message();
  }
  SavedLayout s;
  EXPECT_EQ(saved_layout(LayerDims{-1, 128, 128, 4, 2}, &s).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace megamoe
