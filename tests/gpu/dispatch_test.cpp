// Expert-parallel dispatch, the push (cuda/comm/dispatch.h), the owner's
// routing, plan and pool built from it (cuda/comm/ep_routing.h), and the
// combine's return push (cuda/comm/combine.h), on the
// one-process peer-memory provider: P = 4 ranks on one GPU (any GPU) and
// P = 2 on two GPUs (MultiGpu.*). Every rank's x rows carry a payload that
// encodes (rank, token, column); after the push, slot [s][t] of rank d must
// hold rank s's row t exactly when one of that token's experts lives on d,
// and still hold its poison otherwise; rank d's copy of rank s's routing and
// token count must equal rank s's (ranks have different token counts); every
// flag [s] of rank d (s != d) must hold the call's epoch. A second call with
// other routing and epoch 2 too.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "core/routing_plan.h"
#include "cuda/comm/combine.h"
#include "cuda/comm/dispatch.h"
#include "cuda/comm/ep_routing.h"
#include "cuda/common/device_errors.h"
#include "cuda/plan/device_plan.h"
#include "cuda/comm/peer_memory.h"
#include "gpu_test_util.h"

namespace megamoe::testing {
namespace {

// An expert output of route (source rank, token, slot): never 0x7F7F (the return area's poison).
uint16_t output_payload(int rank, int64_t token, int j, int64_t col) {
  return static_cast<uint16_t>((rank * 331 + token * 29 + j * 1009 + col * 3 + 1) & 0x3FFF);
}

uint16_t payload(int rank, int64_t token, int64_t col) {
  return static_cast<uint16_t>((rank * 7919 + token * 131 + col * 17 + 1) & 0x7FFF);  // never 0xFFFF (the poison)
}

// After a push: rank d's virtual routing (cuda/comm/ep_routing.h) planned by
// the one-GPU plan kernels must give rank d's part of the EP routing plan
// that the host builds from every rank's routing (core/routing_plan.h):
// the same expert segments and the same (source, token, slot) in every pool row.
// Then each rank's pool gathered from where the rows landed (gather_ep_rows)
// must hold, in every row, the x row of the (source, token) the plan names.
void expect_owner_plans_match(const cuda::PeerGroup& group, const cuda::DispatchLayout& layout,
                              const std::vector<std::vector<int32_t>>& idx, const std::vector<int64_t>& counts,
                              const std::vector<const int32_t*>& idx_dev, const std::vector<const void*>& x_dev,
                              int experts, uint32_t epoch) {
  const int world = layout.world, k = layout.top_k, L = experts / world;
  RoutingShape shape;
  shape.num_ranks = world, shape.num_experts = experts, shape.top_k = k, shape.max_tokens_per_rank = layout.max_tokens;
  std::vector<const int32_t*> host_idx;
  for (const auto& v : idx) host_idx.push_back(v.data());
  RoutingPlan reference;
  MEGAMOE_ASSERT_OK(build_routing_plan(shape, host_idx, counts, &reference));
  const int64_t V = world * layout.max_tokens, chunks = V / 256 + 1;
  const int64_t capacity = (V * k + L * 127 + 127) / 128 * 128;
  for (int d = 0; d < world; ++d) {
    const int dev = group.device(d);
    ASSERT_EQ(cudaSetDevice(dev), cudaSuccess);
    cuda::DeviceErrorSink errors;
    MEGAMOE_ASSERT_OK(cuda::device_error_sink(dev, &errors));
    errors.timeout_ns = test_wait_timeout_ns();
    // A source's routing past its token count must not count: make it routes this rank hosts.
    for (int s = 0; s < world; ++s) {
      if (s == d) continue;
      const std::vector<int32_t> hosted(static_cast<size_t>((layout.max_tokens - counts[static_cast<size_t>(s)]) * k),
                                        d * L);
      ASSERT_EQ(cudaMemcpy(static_cast<char*>(group.view(d).local) +
                               layout.ids_offset(s, counts[static_cast<size_t>(s)]),
                           hosted.data(), hosted.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    int32_t *virt = nullptr, *ints = nullptr;
    int64_t* source_counts = nullptr;
    ASSERT_EQ(cudaMalloc(&virt, V * k * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&source_counts, world * 8), cudaSuccess);
    const int64_t n_ints = 4 + 2 * chunks * L + L + (L + 1) + capacity / 128 + V * k + capacity;
    ASSERT_EQ(cudaMalloc(&ints, n_ints * 4), cudaSuccess);
    cuda::DevicePlanBuffers b;
    int32_t* at = ints;
    b.error_key = reinterpret_cast<unsigned long long*>(at), at += 4;
    b.chunk_counts = at, at += 2 * chunks * L;
    b.expert_rows = at, at += L;
    b.expert_offset = at, at += L + 1;
    b.tile_expert = at, at += capacity / 128;
    b.route_row = at, at += V * k;
    b.row_src = at;
    cuda::EpRoutingArgs a;
    a.buffer = group.view(d).local, a.rank = d, a.own_topk_idx = idx_dev[static_cast<size_t>(d)];
    a.own_tokens = counts[static_cast<size_t>(d)], a.experts_per_rank = L, a.epoch = epoch, a.errors = errors;
    a.virtual_idx = virt, a.source_counts = source_counts;
    MEGAMOE_ASSERT_OK(cuda::build_ep_virtual_routing(layout, a, nullptr));
    MEGAMOE_ASSERT_OK(cuda::build_device_plan(virt, V, k, L, b, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    MEGAMOE_ASSERT_OK(cuda::take_device_error(dev, nullptr));
    const RankPlan& want = reference.ranks[static_cast<size_t>(d)];
    std::vector<int32_t> offset(static_cast<size_t>(L + 1));
    ASSERT_EQ(cudaMemcpy(offset.data(), b.expert_offset, (L + 1) * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int l = 0; l <= L; ++l)
      EXPECT_EQ(offset[static_cast<size_t>(l)], want.expert_offset[static_cast<size_t>(l)]) << "rank " << d << " expert " << l;
    const int64_t rows = want.pool_rows();
    std::vector<int32_t> src(static_cast<size_t>(rows));
    ASSERT_EQ(cudaMemcpy(src.data(), b.row_src, rows * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    int64_t wrong = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const RowSource& w = want.row_source[static_cast<size_t>(r)];
      const int32_t v = src[static_cast<size_t>(r)];
      const bool same = w.rank < 0 ? v < 0
                                   : v >= 0 && v / k / layout.max_tokens == w.rank &&
                                         v / k % layout.max_tokens == w.token && v % k == w.slot;
      wrong += !same;
    }
    EXPECT_EQ(wrong, 0) << "rank " << d << ": pool rows whose source differs from the host plan, of " << rows;
    const int64_t H = layout.hidden;
    uint16_t* pool = nullptr;
    ASSERT_EQ(cudaMalloc(&pool, capacity * H * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(pool, 0xFF, capacity * H * 2), cudaSuccess);
    MEGAMOE_ASSERT_OK(cuda::gather_ep_rows(layout, group.view(d).local, d, x_dev[static_cast<size_t>(d)], b.row_src,
                                           b.expert_offset + L, capacity, pool, nullptr));
    std::vector<uint16_t> got(static_cast<size_t>(rows * H));
    ASSERT_EQ(cudaMemcpy(got.data(), pool, rows * H * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    int64_t wrong_pool_rows = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const RowSource& w = want.row_source[static_cast<size_t>(r)];
      for (int64_t c = 0; c < H; ++c) {
        const uint16_t expect = w.rank < 0 ? uint16_t{0} : payload(w.rank, w.token, c);
        if (got[static_cast<size_t>(r * H + c)] != expect) {
          ++wrong_pool_rows;
          break;
        }
      }
    }
    EXPECT_EQ(wrong_pool_rows, 0) << "rank " << d << ": gathered pool rows that are not their source's x row";

    // The combine's return push (cuda/comm/combine.h): this owner's output of
    // every route it computed, [j][v] in virtual tokens, back to its source.
    std::vector<uint16_t> outputs(static_cast<size_t>(k * V * H), 0x5555);
    for (int64_t v = 0; v < V; ++v) {
      const int s = static_cast<int>(v / layout.max_tokens);
      const int64_t t = v % layout.max_tokens;
      if (t >= counts[static_cast<size_t>(s)]) continue;
      for (int j = 0; j < k; ++j) {
        const int e = idx[static_cast<size_t>(s)][static_cast<size_t>(t * k + j)];
        if (e < 0 || e / L != d) continue;
        for (int64_t c = 0; c < H; ++c)
          outputs[static_cast<size_t>((j * V + v) * H + c)] = output_payload(s, t, j, c);
      }
    }
    uint16_t* outputs_dev = nullptr;
    uint32_t* done = nullptr;
    ASSERT_EQ(cudaMalloc(&outputs_dev, outputs.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&done, 4), cudaSuccess);
    ASSERT_EQ(cudaMemset(done, 0, 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(outputs_dev, outputs.data(), outputs.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    cuda::CombineArgs c;
    c.outputs = outputs_dev, c.virtual_idx = virt, c.source_counts = source_counts, c.epoch = epoch,
    c.blocks_done = done;
    MEGAMOE_ASSERT_OK(cuda::combine_push(group.view(d), layout, c, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaFree(outputs_dev);
    cudaFree(done);
    cudaFree(pool);
    cudaFree(virt);
    cudaFree(ints);
    cudaFree(source_counts);
  }

  // Every source: its combine flags from every owner (itself included) and,
  // in its return area, the output of each of its routes; slots of dropped
  // routes keep their poison.
  for (int s = 0; s < world; ++s) {
    const int dev = group.device(s);
    ASSERT_EQ(cudaSetDevice(dev), cudaSuccess);
    cuda::DeviceErrorSink errors;
    MEGAMOE_ASSERT_OK(cuda::device_error_sink(dev, &errors));
    errors.timeout_ns = test_wait_timeout_ns();
    MEGAMOE_ASSERT_OK(cuda::combine_wait(layout, group.view(s).local, epoch, errors, nullptr));
    MEGAMOE_ASSERT_OK(cuda::sync_and_take_device_error(dev, nullptr));
    std::vector<uint8_t> buf(layout.bytes());
    ASSERT_EQ(cudaMemcpy(buf.data(), group.view(s).local, buf.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    const auto* flags = reinterpret_cast<const uint32_t*>(buf.data() + cuda::DispatchLayout::kCombineFlagsOffset);
    for (int d = 0; d < world; ++d) EXPECT_EQ(flags[d], epoch) << "rank " << s << "'s combine flag from owner " << d;
    const int64_t n = counts[static_cast<size_t>(s)], H = layout.hidden;
    int64_t wrong_slots = 0;
    for (int j = 0; j < k; ++j)
      for (int64_t t = 0; t < n; ++t) {
        const bool routed = idx[static_cast<size_t>(s)][static_cast<size_t>(t * k + j)] >= 0;
        const auto* slot = reinterpret_cast<const uint16_t*>(buf.data() + layout.combine_slot_offset(j, t));
        for (int64_t c = 0; c < H; ++c)
          if (slot[c] != (routed ? output_payload(s, t, j, c) : uint16_t{0x7F7F})) {
            ++wrong_slots;
            break;
          }
      }
    EXPECT_EQ(wrong_slots, 0) << "rank " << s << "'s combine slots, epoch " << epoch;
  }
}

void push_and_check(const std::vector<int>& devices) {
  const int world = static_cast<int>(devices.size());
  const int experts = 4 * world, per_rank = 4, k = 3;
  const int64_t tokens = 300, hidden = 128;
  cuda::DispatchLayout layout;
  layout.world = world, layout.max_tokens = tokens, layout.hidden = hidden, layout.top_k = k;
  std::unique_ptr<cuda::PeerGroup> group;
  MEGAMOE_ASSERT_OK(cuda::make_one_process_group(devices, layout.bytes(), &group));

  struct Rank {
    void* x = nullptr;
    int32_t* idx = nullptr;
    float* w = nullptr;
    uint32_t* done = nullptr;
    std::vector<uint16_t> x_host;
    std::vector<int32_t> idx_host;
    std::vector<float> w_host;
  };
  std::vector<Rank> ranks(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
    Rank& R = ranks[static_cast<size_t>(r)];
    ASSERT_EQ(cudaMalloc(&R.x, tokens * hidden * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&R.idx, tokens * k * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&R.w, tokens * k * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&R.done, 4), cudaSuccess);
    ASSERT_EQ(cudaMemset(R.done, 0, 4), cudaSuccess);
    R.x_host.resize(static_cast<size_t>(tokens * hidden));
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t c = 0; c < hidden; ++c) R.x_host[static_cast<size_t>(t * hidden + c)] = payload(r, t, c);
    ASSERT_EQ(cudaMemcpy(R.x, R.x_host.data(), tokens * hidden * 2, cudaMemcpyHostToDevice), cudaSuccess);
  }

  // Token counts differ by rank and by call, so a count that was not written shows.
  auto count = [&](int r, uint32_t epoch) { return tokens - r - 7 * static_cast<int64_t>(epoch - 1); };
  std::mt19937 rng(5);
  for (uint32_t epoch = 1; epoch <= 2; ++epoch) {
    // Fresh routing (k distinct experts per token, some routes dropped) and poisoned receive areas.
    for (int r = 0; r < world; ++r) {
      Rank& R = ranks[static_cast<size_t>(r)];
      R.idx_host.assign(static_cast<size_t>(tokens * k), -1);
      for (int64_t t = 0; t < tokens; ++t) {
        std::vector<int> pick(static_cast<size_t>(experts));
        for (int e = 0; e < experts; ++e) pick[static_cast<size_t>(e)] = e;
        std::shuffle(pick.begin(), pick.end(), rng);
        for (int j = 0; j < k; ++j)
          R.idx_host[static_cast<size_t>(t * k + j)] = rng() % 10 == 0 ? -1 : pick[static_cast<size_t>(j)];
      }
      ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(R.idx, R.idx_host.data(), tokens * k * 4, cudaMemcpyHostToDevice), cudaSuccess);
      // Weights that name their (rank, token, slot, call): exact in fp32.
      R.w_host.resize(static_cast<size_t>(tokens * k));
      for (int64_t i = 0; i < tokens * k; ++i)
        R.w_host[static_cast<size_t>(i)] = static_cast<float>(r * 100000 + i) + 0.25f * static_cast<float>(epoch);
      ASSERT_EQ(cudaMemcpy(R.w, R.w_host.data(), tokens * k * 4, cudaMemcpyHostToDevice), cudaSuccess);
      // Poison: rows 0xFF (never a payload), the header (flags, counts) 0xA5, and the
      // routing copies 0x7F7F7F7F (neither an expert id nor -1, "no route").
      const cuda::PeerView v = group->view(r);
      char* base = static_cast<char*>(v.local);
      ASSERT_EQ(cudaMemset(base, 0xA5, cuda::DispatchLayout::kRecvOffset), cudaSuccess);
      // The combine flags below any epoch, so that a wait that read them could not pass early.
      ASSERT_EQ(cudaMemset(base + cuda::DispatchLayout::kCombineFlagsOffset, 0, 32), cudaSuccess);
      ASSERT_EQ(cudaMemset(base + cuda::DispatchLayout::kRecvOffset, 0xFF,
                           layout.ids_offset() - cuda::DispatchLayout::kRecvOffset),
                cudaSuccess);
      ASSERT_EQ(cudaMemset(base + layout.ids_offset(), 0x7F, layout.bytes() - layout.ids_offset()), cudaSuccess);
    }
    for (int d : devices) {
      ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
      cuda::DispatchArgs a;
      a.x = ranks[static_cast<size_t>(r)].x, a.topk_idx = ranks[static_cast<size_t>(r)].idx;
      a.topk_weights = ranks[static_cast<size_t>(r)].w;
      a.tokens = count(r, epoch), a.experts_per_rank = per_rank, a.epoch = epoch;
      a.blocks_done = ranks[static_cast<size_t>(r)].done;
      MEGAMOE_ASSERT_OK(cuda::dispatch_push(group->view(r), layout, a, nullptr));
    }
    for (int d : devices) {
      ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    for (int d = 0; d < world; ++d) {
      std::vector<uint8_t> buf(layout.bytes());
      ASSERT_EQ(cudaMemcpy(buf.data(), group->view(d).local, buf.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      const auto* flags = reinterpret_cast<const uint32_t*>(buf.data());
      const auto* counts = reinterpret_cast<const uint32_t*>(buf.data() + cuda::DispatchLayout::kTokensOffset);
      int64_t wrong_rows = 0, wrong_ids = 0, wrong_weights = 0, sent = 0;
      for (int s = 0; s < world; ++s) {
        // Every source's weights, this rank's own included; past its count untouched.
        const auto* w = reinterpret_cast<const uint32_t*>(buf.data() + layout.weights_offset(s, 0));
        for (int64_t i = 0; i < tokens * k; ++i) {
          uint32_t want = 0x7F7F7F7Fu;
          if (i < count(s, epoch) * k) std::memcpy(&want, &ranks[static_cast<size_t>(s)].w_host[static_cast<size_t>(i)], 4);
          wrong_weights += w[i] != want;
        }
        if (s == d) continue;
        EXPECT_EQ(flags[s], epoch) << "rank " << d << "'s flag from rank " << s;
        const int64_t n = count(s, epoch);
        EXPECT_EQ(counts[s], static_cast<uint32_t>(n)) << "rank " << d << "'s token count of rank " << s;
        const Rank& S = ranks[static_cast<size_t>(s)];
        const auto* ids = reinterpret_cast<const int32_t*>(buf.data() + layout.ids_offset(s, 0));
        for (int64_t i = 0; i < n * k; ++i) wrong_ids += ids[i] != S.idx_host[static_cast<size_t>(i)];
        for (int64_t i = n * k; i < tokens * k; ++i) wrong_ids += ids[i] != 0x7F7F7F7F;  // past the count: untouched
        for (int64_t t = 0; t < tokens; ++t) {  // tokens past the count must stay untouched
          bool goes = false;
          for (int j = 0; j < k && t < n; ++j) {
            const int e = S.idx_host[static_cast<size_t>(t * k + j)];
            goes = goes || (e >= 0 && e / per_rank == d);
          }
          sent += goes;
          const auto* slot = reinterpret_cast<const uint16_t*>(buf.data() + layout.slot_offset(s, t));
          for (int64_t c = 0; c < hidden; ++c) {
            const uint16_t want = goes ? S.x_host[static_cast<size_t>(t * hidden + c)] : uint16_t{0xFFFF};
            if (slot[c] != want) {
              ++wrong_rows;
              break;
            }
          }
        }
      }
      EXPECT_EQ(flags[d], 0xA5A5A5A5u) << "rank " << d << " wrote its own flag";
      EXPECT_EQ(counts[d], 0xA5A5A5A5u) << "rank " << d << " wrote its own count";
      EXPECT_EQ(wrong_rows, 0) << "rank " << d << ", epoch " << epoch;
      EXPECT_EQ(wrong_ids, 0) << "rank " << d << "'s copy of the routing, epoch " << epoch;
      EXPECT_EQ(wrong_weights, 0) << "rank " << d << "'s copy of the routing weights, epoch " << epoch;
      EXPECT_GT(sent, 0) << "rank " << d << " received nothing: the test would prove little";
    }
    std::vector<std::vector<int32_t>> idx;
    std::vector<int64_t> counts;
    std::vector<const int32_t*> idx_dev;
    std::vector<const void*> x_dev;
    for (int r = 0; r < world; ++r) {
      x_dev.push_back(ranks[static_cast<size_t>(r)].x);
      const int64_t n = count(r, epoch);
      const auto& h = ranks[static_cast<size_t>(r)].idx_host;
      idx.emplace_back(h.begin(), h.begin() + n * k);
      counts.push_back(n);
      idx_dev.push_back(ranks[static_cast<size_t>(r)].idx);
    }
    expect_owner_plans_match(*group, layout, idx, counts, idx_dev, x_dev, experts, epoch);
  }
  for (int r = 0; r < world; ++r) {
    cudaSetDevice(group->device(r));
    cudaFree(ranks[static_cast<size_t>(r)].x);
    cudaFree(ranks[static_cast<size_t>(r)].idx);
    cudaFree(ranks[static_cast<size_t>(r)].w);
    cudaFree(ranks[static_cast<size_t>(r)].done);
  }
  cudaSetDevice(0);
}

TEST(Dispatch, FourRanksOnOneGpuPushEveryRowOncePerRank) {
  MEGAMOE_REQUIRE_GPU();
  push_and_check({0, 0, 0, 0});
}

// A rank that never enters the call: the owner's routing wait gives up after
// its bound and the error names the missing rank; the context stays usable.
TEST(Dispatch, ARankThatNeverDeliversIsNamed) {
  MEGAMOE_REQUIRE_GPU();
  cuda::DispatchLayout layout;
  layout.world = 2, layout.max_tokens = 1024, layout.hidden = 128, layout.top_k = 2;
  const int64_t entries = layout.max_tokens * layout.top_k;
  std::unique_ptr<cuda::PeerGroup> group;
  MEGAMOE_ASSERT_OK(cuda::make_one_process_group({0, 0}, layout.bytes(), &group));
  int32_t *virt = nullptr, *own = nullptr;
  int64_t* source_counts = nullptr;
  ASSERT_EQ(cudaMalloc(&virt, 2 * entries * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&own, entries * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&source_counts, 2 * 8), cudaSuccess);
  // Rank 0's own routes: token t to experts t % 4 and (t + 1) % 4 (experts 0, 1 live on rank 0).
  std::vector<int32_t> own_host(static_cast<size_t>(entries));
  for (int64_t t = 0; t < layout.max_tokens; ++t)
    for (int j = 0; j < 2; ++j) own_host[static_cast<size_t>(t * 2 + j)] = static_cast<int32_t>((t + j) % 4);
  ASSERT_EQ(cudaMemcpy(own, own_host.data(), entries * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(virt, 0x7F, 2 * entries * 4), cudaSuccess);
  cuda::EpRoutingArgs a;
  a.buffer = group->view(0).local, a.rank = 0, a.own_topk_idx = own, a.own_tokens = layout.max_tokens;
  a.experts_per_rank = 2, a.epoch = 1, a.virtual_idx = virt, a.source_counts = source_counts;
  MEGAMOE_ASSERT_OK(cuda::device_error_sink(0, &a.errors));  // rank 1 never pushed: its flag stays 0
  a.errors.timeout_ns = under_cuda_tool() ? 5'000'000'000ull : 50'000'000ull;
  MEGAMOE_ASSERT_OK(cuda::build_ep_virtual_routing(layout, a, nullptr));
  const Status st = cuda::sync_and_take_device_error(0, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_NE(st.message().find("EP routing: rank 1 never delivered its part"), std::string::npos) << st.message();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  // The rank's own part is built all the same; the missing rank's part is empty.
  std::vector<int32_t> got(static_cast<size_t>(2 * entries));
  ASSERT_EQ(cudaMemcpy(got.data(), virt, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  int64_t wrong_own = 0, wrong_missing = 0;
  for (int64_t i = 0; i < entries; ++i) {
    const int32_t e = own_host[static_cast<size_t>(i)];
    wrong_own += got[static_cast<size_t>(i)] != (e < 2 ? e : -1);
    wrong_missing += got[static_cast<size_t>(entries + i)] != -1;
  }
  EXPECT_EQ(wrong_own, 0);
  EXPECT_EQ(wrong_missing, 0);
  // The context is still usable: a small copy and a sync succeed.
  int32_t probe = 0;
  EXPECT_EQ(cudaMemcpy(&probe, virt, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(virt);
  cudaFree(own);
  cudaFree(source_counts);
}

// A source waiting for an owner that never returns its outputs: the error names it.
TEST(Dispatch, AnOwnerThatNeverReturnsIsNamed) {
  MEGAMOE_REQUIRE_GPU();
  cuda::DispatchLayout layout;
  layout.world = 2, layout.max_tokens = 64, layout.hidden = 128, layout.top_k = 2;
  std::unique_ptr<cuda::PeerGroup> group;
  MEGAMOE_ASSERT_OK(cuda::make_one_process_group({0, 0}, layout.bytes(), &group));
  // Owner 0 (this rank) has returned; owner 1 never comes.
  const uint32_t done = 1;
  ASSERT_EQ(cudaMemcpy(static_cast<char*>(group->view(0).local) + cuda::DispatchLayout::kCombineFlagsOffset, &done,
                       4, cudaMemcpyHostToDevice),
            cudaSuccess);
  cuda::DeviceErrorSink errors;
  MEGAMOE_ASSERT_OK(cuda::device_error_sink(0, &errors));
  errors.timeout_ns = under_cuda_tool() ? 5'000'000'000ull : 50'000'000ull;
  // The combine's error key, clean before the wait: the timeout must mark it.
  unsigned long long* key = nullptr;
  ASSERT_EQ(cudaMalloc(&key, sizeof *key), cudaSuccess);
  ASSERT_EQ(cudaMemset(key, 0xFF, sizeof *key), cudaSuccess);
  MEGAMOE_ASSERT_OK(cuda::combine_wait(layout, group->view(0).local, 1, errors, nullptr, key));
  const Status st = cuda::sync_and_take_device_error(0, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_NE(st.message().find("EP combine: rank 1 never delivered its part"), std::string::npos) << st.message();
  unsigned long long seen = 0;
  ASSERT_EQ(cudaMemcpy(&seen, key, sizeof seen, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(seen, static_cast<unsigned long long>(cuda::kPlanErrorPeer)) << "the wait did not poison the combine";
  cudaFree(key);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// Peer memory comes in multiples of 256 bytes, so the layout asks for that
// (a layout of 552320 bytes once failed the group's creation).
TEST(Dispatch, LayoutBytesAreAWholeNumberOf256AndHoldTheLastSlot) {
  for (int world : {1, 2, 3, 8})
    for (int64_t max_tokens : {1, 10, 129, 4097})
      for (int hidden : {8, 136, 2048})
        for (int top_k : {1, 3, 8}) {
          cuda::DispatchLayout layout;
          layout.world = world, layout.max_tokens = max_tokens, layout.hidden = hidden, layout.top_k = top_k;
          const size_t end = layout.route_values_offset() + static_cast<size_t>(max_tokens) * top_k * 4;
          EXPECT_GE(layout.route_values_offset(),
                    layout.combine_slot_offset(top_k - 1, max_tokens - 1) + layout.slot_bytes());
          EXPECT_EQ(layout.bytes() % 256, 0u) << world << " " << max_tokens << " " << hidden << " " << top_k;
          EXPECT_GE(layout.bytes(), end);
          EXPECT_LT(layout.bytes(), end + 256);
        }
}

TEST(Dispatch, BadArgumentsAreErrorsBeforeAnyWrite) {
  cuda::DispatchLayout layout;
  layout.world = 2, layout.max_tokens = 10, layout.hidden = 128, layout.top_k = 1;
  void* fake[2] = {reinterpret_cast<void*>(0x1000), reinterpret_cast<void*>(0x2000)};
  cuda::PeerView v;
  v.rank = 0, v.world = 2, v.local = fake[0], v.peers = fake, v.bytes = layout.bytes();
  uint32_t done = 0;
  int32_t idx = 0;
  uint16_t x = 0;
  cuda::DispatchArgs a;
  a.x = &x, a.topk_idx = &idx, a.tokens = 11, a.experts_per_rank = 1, a.epoch = 1, a.blocks_done = &done;
  Status st = cuda::dispatch_push(v, layout, a, nullptr);
  EXPECT_NE(st.message().find("11 tokens, but the receive area holds 10 per source rank"), std::string::npos)
      << st.to_string();
  a.tokens = 10, a.epoch = 0;
  st = cuda::dispatch_push(v, layout, a, nullptr);
  EXPECT_NE(st.message().find("epoch 0"), std::string::npos) << st.to_string();
  a.epoch = 1;
  for (int64_t bad : {int64_t{8}, int64_t{-16}, int64_t{272}}) {  // not whole 16-byte pieces, negative, past the slot
    a.row_bytes = bad;
    st = cuda::dispatch_push(v, layout, a, nullptr);
    EXPECT_NE(st.message().find("row_bytes = " + std::to_string(bad) + " must be a multiple of 16 no larger than a slot"),
              std::string::npos)
        << st.to_string();
  }
  a.row_bytes = 0;
  v.bytes = layout.bytes() - 1;
  st = cuda::dispatch_push(v, layout, a, nullptr);
  EXPECT_NE(st.message().find("symmetric buffer has"), std::string::npos) << st.to_string();
}

TEST(MultiGpu, DispatchPushOverNvlink) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) GTEST_SKIP() << "needs 2 GPUs, " << n << " visible";
  push_and_check({0, 1});
}

}  // namespace
}  // namespace megamoe::testing
