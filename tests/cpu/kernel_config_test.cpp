// The grouped GEMM's kernel selection on the CPU (cuda/gemm/kernel_config.h):
// every GEMM the layer's steps make (built by cuda/layer/layer_gemms.h, as
// the steps build them) over a grid of shapes, precisions, paths and roles
// (one GPU, expert-parallel owner) selects a kernel that is built; the
// configs the layer relies on have the named fields they should; every
// precondition refuses what it guards, naming it. Nothing here launches: the
// buffers are fake device addresses, carved as the layer carves them.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/gemm/kernel_config.h"
#include "cuda/layer/call_buffers.h"
#include "cuda/layer/ep_layer.h"
#include "cuda/layer/layer_gemms.h"

namespace megamoe::cuda {
namespace {

using engine::KernelKey;
using engine::RowHold;
using engine::TileShape;

constexpr int kSms = 132;

// A fake, 256-byte aligned device address for region `n` (never dereferenced).
void* fake(int n) { return reinterpret_cast<void*>(uintptr_t{1} << 40 | uintptr_t(n) << 32); }

struct Site {
  LayerCall call;
  CallBuffers buf;
};

// A call's buffers, carved from fake addresses as the layer carves them.
Site site(const LayerDims& d, const CudaPaths& paths, bool ep_owner) {
  Site s;
  s.call.dims = d, s.call.paths = paths, s.call.slots_at_sources = ep_owner;
  MoeBuffers b;
  b.scratch = fake(1), b.saved = fake(2), b.fp8_weights = fake(3);
  EXPECT_TRUE(carve_call_buffers(s.call, b, &s.buf).ok());
  return s;
}

struct LayerGemm {
  std::string name;
  GroupedGemmArgs args;
};

// Every GEMM one call of the layer launches, as its steps (layer_steps.cpp)
// build them: the forward, the backward's recomputed GEMM1, the data and
// weight gradients; the bf16 gate/up also without its own gather (the
// fallback where its cooperative launch is refused).
std::vector<LayerGemm> layer_gemms(const Site& s, const EpGroup* ep) {
  const LayerCall& c = s.call;
  const CallBuffers& b = s.buf;
  const void* w13 = fake(10);
  const void* w2 = fake(11);
  const float* topk_w = static_cast<const float*>(fake(12));
  const int32_t* topk_idx = static_cast<const int32_t*>(fake(13));
  const void* x = ep != nullptr ? fake(14) : fake(15);  // an owner's x: its receive area, the virtual token matrix
  const LayerGrads grads{fake(16), static_cast<float*>(fake(17)), fake(18), fake(19), true, false};
  PeerSlots peer;
  if (ep != nullptr) peer = ep_return_slots(*ep, static_cast<const int64_t*>(fake(20)));
  const PeerSlots* to = ep != nullptr ? &peer : nullptr;
  std::vector<LayerGemm> g;
  const bool own_gather = forward_side_jobs(c);
  g.push_back({"gate_up", gate_up_gemm(c, b, w13, b.z_pool, b.a_pool, own_gather ? x : nullptr)});
  g.push_back({"gate_up, rows pooled first", gate_up_gemm(c, b, w13, b.z_pool, b.a_pool)});
  g.push_back({"gate_up, z only (recompute)", gate_up_gemm(c, b, w13, b.z_pool, nullptr, own_gather ? x : nullptr)});
  g.push_back({"down", down_gemm(c, b, w2, topk_w, to)});
  g.push_back({"down_grad", down_grad_gemm(c, b, w2, topk_w)});
  const bool side = ep == nullptr && backward_side_jobs(c);
  g.push_back({"gate_up_grad", gate_up_grad_gemm(c, b, w13, to, side ? x : nullptr)});
  g.push_back({"down_weight_grad", down_weight_grad_gemm(c, b, grads)});
  const SideCombine dx = dx_side_combine(c, b, topk_idx, grads.dx);
  g.push_back({"gate_up_weight_grad", gate_up_weight_grad_gemm(c, b, grads, side ? &dx : nullptr)});
  return g;
}

std::string describe(const LayerDims& d, const CudaPaths& p, int world) {
  return "H " + std::to_string(d.hidden) + " I " + std::to_string(d.intermediate) + " E " +
         std::to_string(d.num_experts) + " k " + std::to_string(d.top_k) + " T " + std::to_string(d.tokens) + " " +
         to_string(d.precision) + (d.fp8_scale == ScaleMode::kPowerOfTwo ? "/pow2" : "") + " world " +
         std::to_string(world) + (p.side_jobs ? "" : " no-side-jobs") + (p.rows_first ? "" : " no-rows-first") +
         (p.down_to_pool ? "" : " slots");
}

// How many of `gemms` select no built kernel (each one reported where `report`).
int unselectable(const std::vector<LayerGemm>& gemms, const std::string& where, bool report = true) {
  int bad = 0;
  for (const LayerGemm& g : gemms) {
    KernelConfig cfg;
    const Status st = select_kernel(g.args, kSms, {}, &cfg);
    const bool ok = st.ok() && engine::kernel_is_built(cfg.key);
    if (!ok && report) ADD_FAILURE() << where << ", " << g.name << ": " << st.to_string();
    bad += !ok;
  }
  return bad;
}

TEST(KernelConfig, EveryLayerCallSelectsABuiltKernel) {
  int calls = 0, gemms = 0;
  for (const int64_t H : {128, 256, 384, 2048, 4096, 7168})
    for (const int64_t I : {128, 256, 384, 768, 1536, 2048})
      for (const auto& [E, k] : std::vector<std::pair<int, int>>{{8, 2}, {128, 8}})
        for (const Precision prec : {Precision::kBF16, Precision::kFP8, Precision::kFP8Bwd})
          for (const ScaleMode scale : {ScaleMode::kFloat32, ScaleMode::kPowerOfTwo})
            for (int paths = 0; paths < 8; ++paths) {
              if (prec == Precision::kBF16 && scale == ScaleMode::kPowerOfTwo) continue;
              CudaPaths p;
              p.side_jobs = (paths & 1) == 0, p.rows_first = (paths & 2) == 0, p.down_to_pool = (paths & 4) == 0;
              LayerDims d;
              d.hidden = H, d.intermediate = I, d.num_experts = E, d.top_k = k, d.precision = prec;
              d.fp8_scale = scale;
              d.tokens = 300;
              const Site one = site(d, p, false);
              const auto g = layer_gemms(one, nullptr);
              EXPECT_EQ(unselectable(g, describe(d, p, 1)), 0);
              gemms += static_cast<int>(g.size()), ++calls;
              for (const int world : {1, 2, 8}) {  // an expert-parallel owner of E / world experts
                if (E % world != 0) continue;
                EpGroup ep;
                ep.layout.world = world, ep.layout.max_tokens = 150, ep.layout.hidden = H, ep.layout.top_k = k;
                ep.view.world = world, ep.view.peers = static_cast<void* const*>(fake(21));
                ep.num_experts = E;
                LayerDims owner = ep_owner_dims(ep, I);
                owner.precision = prec, owner.fp8_scale = scale;
                const Site s = site(owner, p, true);
                const auto ge = layer_gemms(s, &ep);
                EXPECT_EQ(unselectable(ge, describe(owner, p, world)), 0);
                gemms += static_cast<int>(ge.size()), ++calls;
              }
            }
  std::printf("  %d layer calls, %d GEMMs: every one selects a built kernel\n", calls, gemms);
}

// The check above can fail: a GEMM that needs an instantiation that is not
// built (bf16 kGateUp in 128 x 128 tiles) is refused, and counted.
TEST(KernelConfig, AGemmThatNeedsAnUnbuiltKernelIsCaught) {
  LayerDims d;
  d.hidden = 2048, d.intermediate = 768, d.num_experts = 128, d.top_k = 8, d.tokens = 300;
  const Site s = site(d, CudaPaths{}, false);
  GemmOverrides narrow;
  narrow.narrow_tiles = true;
  KernelConfig cfg;
  const Status st = select_kernel(gate_up_gemm(s.call, s.buf, fake(10), s.buf.z_pool, s.buf.a_pool), kSms, narrow, &cfg);
  EXPECT_EQ(st.code(), StatusCode::kUnimplemented) << st.to_string();
  EXPECT_NE(st.message().find("kGateUp bf16 128x128 is not built"), std::string::npos) << st.to_string();
  EXPECT_FALSE(engine::kernel_is_built(KernelKey{GemmMode::kGateUp, ElemType::kBF16, TileShape::k128x128,
                                                 RowHold::kNone}));
  EXPECT_FALSE(engine::kernel_is_built(KernelKey{GemmMode::kDownGrad, ElemType::kBF16, TileShape::k128x256,
                                                 RowHold::kNone}));
  GroupedGemmArgs held = down_gemm(s.call, s.buf, fake(11), static_cast<const float*>(fake(12)));
  held.arrival.rows_ready = static_cast<const uint32_t*>(fake(22)), held.arrival.ready_value = 1;
  EXPECT_EQ(unselectable({{"kDown with held rows", held}, {"kDown", down_gemm(s.call, s.buf, fake(11), nullptr)}},
                         "unbuilt", false),
            1);
}

KernelConfig config_of(const GroupedGemmArgs& g) {
  KernelConfig cfg;
  const Status st = select_kernel(g, kSms, {}, &cfg);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return cfg;
}

// The configs the layer relies on, field by field (Qwen3-30B-A3B and -235B-A22B shapes).
TEST(KernelConfig, TheLayersConfigsHaveTheirNamedFields) {
  LayerDims d;
  d.hidden = 2048, d.intermediate = 768, d.num_experts = 128, d.top_k = 8, d.tokens = 16384;
  const Site s = site(d, CudaPaths{}, false);
  const KernelConfig up = config_of(gate_up_gemm(s.call, s.buf, fake(10), s.buf.z_pool, s.buf.a_pool, fake(15)));
  EXPECT_EQ(up.key.tile, TileShape::k128x256);
  EXPECT_EQ(up.key.hold, RowHold::kWaitForRows);
  EXPECT_TRUE(up.cooperative);
  EXPECT_EQ(up.tile_order, TileOrder::kColumnsFirst);  // 30B's w13: 6 MB an expert
  EXPECT_EQ(up.n_tiles, 768 / 128);
  EXPECT_EQ(up.stages, 4);
  EXPECT_EQ(up.describe(), "kGateUp bf16 128x256 held-rows cooperative, 4 stages");
  const KernelConfig down = config_of(down_gemm(s.call, s.buf, fake(11), static_cast<const float*>(fake(12))));
  EXPECT_EQ(down.key.tile, TileShape::k128x256);
  EXPECT_EQ(down.b_major, Majorness::kKMajor);
  const KernelConfig dg = config_of(down_grad_gemm(s.call, s.buf, fake(11), static_cast<const float*>(fake(12))));
  EXPECT_EQ(dg.key.tile, TileShape::k128x128);
  EXPECT_EQ(dg.b_major, Majorness::kMnMajor);
  EXPECT_EQ(dg.stages, 5);
  const LayerGrads grads{fake(16), static_cast<float*>(fake(17)), fake(18), fake(19), true, false};
  const KernelConfig wg = config_of(down_weight_grad_gemm(s.call, s.buf, grads));
  EXPECT_EQ(wg.a_major, Majorness::kMnMajor);
  EXPECT_EQ(wg.key.tile, TileShape::k128x256);  // I = 768: whole 256-column tiles
  // 235B in FP8: the data gradients on split rings, B transposed; weights over 10 MB an expert walk rows first.
  d.hidden = 4096, d.intermediate = 1536, d.precision = Precision::kFP8;
  const Site s8 = site(d, CudaPaths{}, false);
  const KernelConfig up8 = config_of(gate_up_gemm(s8.call, s8.buf, fake(10), s8.buf.z_pool, s8.buf.a_pool));
  EXPECT_TRUE(up8.split_rings && up8.paired_columns);
  EXPECT_EQ(up8.tile_order, TileOrder::kRowsFirst);
  EXPECT_EQ(up8.k_blocks, 4096 / 128);
  const KernelConfig gx8 = config_of(gate_up_grad_gemm(s8.call, s8.buf, fake(10)));
  EXPECT_EQ(gx8.key.elem, ElemType::kE4M3);
  EXPECT_EQ(gx8.b_major, Majorness::kKMajor);
  const KernelConfig w8 = config_of(gate_up_weight_grad_gemm(s8.call, s8.buf, grads));
  EXPECT_TRUE(w8.scale_ring);
  EXPECT_EQ(w8.stages, 6);
  // The paths are runtime options: rows first off walks columns first.
  CudaPaths no_rows_first;
  no_rows_first.rows_first = false;
  const Site s8b = site(d, no_rows_first, false);
  EXPECT_EQ(config_of(gate_up_gemm(s8b.call, s8b.buf, fake(10), nullptr, s8b.buf.a_pool)).tile_order,
            TileOrder::kColumnsFirst);
  // Every built kernel's shared memory within a CTA's 227 KB.
  engine::for_each_built_kernel([](auto spec) {
    using Spec = decltype(spec);
    EXPECT_LE(engine::smem_bytes<Spec>(), engine::kMaxSmemBytes);
  });
}

// A valid bf16 GEMM of each mode, for the refusals below to break one thing at a time.
struct Refusal {
  const char* what;
  GroupedGemmArgs args;
  StatusCode code;
  const char* words;
};

TEST(KernelConfig, EveryPreconditionRefusesWhatItGuards) {
  LayerDims d;
  d.hidden = 256, d.intermediate = 256, d.num_experts = 8, d.top_k = 2, d.tokens = 300;
  const Site s = site(d, CudaPaths{}, false);
  d.precision = Precision::kFP8;
  const Site s8 = site(d, CudaPaths{}, false);
  const LayerCall& c = s.call;
  const CallBuffers& b = s.buf;
  const LayerGrads grads{fake(16), static_cast<float*>(fake(17)), fake(18), fake(19), true, false};
  const float* w = static_cast<const float*>(fake(12));
  const GroupedGemmArgs up = gate_up_gemm(c, b, fake(10), b.z_pool, b.a_pool);
  const GroupedGemmArgs own = gate_up_gemm(c, b, fake(10), b.z_pool, b.a_pool, fake(15));
  const GroupedGemmArgs down = down_gemm(c, b, fake(11), w);
  const GroupedGemmArgs dgrad = down_grad_gemm(c, b, fake(11), w);
  const GroupedGemmArgs xgrad = gate_up_grad_gemm(c, b, fake(10));
  const GroupedGemmArgs wgrad = gate_up_weight_grad_gemm(c, b, grads);
  const GroupedGemmArgs up8 = gate_up_gemm(s8.call, s8.buf, fake(10), s8.buf.z_pool, s8.buf.a_pool);
  const GroupedGemmArgs dgrad8 = down_grad_gemm(s8.call, s8.buf, fake(11), w);
  const GroupedGemmArgs wgrad8 = gate_up_weight_grad_gemm(s8.call, s8.buf, grads);
  for (const GroupedGemmArgs& ok : {up, own, down, dgrad, xgrad, wgrad, up8, dgrad8, wgrad8}) {
    KernelConfig cfg;
    EXPECT_TRUE(select_kernel(ok, kSms, {}, &cfg).ok());
  }
  auto with = [](GroupedGemmArgs g, auto change) {
    change(g);
    return g;
  };
  using S = StatusCode;
  const std::vector<Refusal> refusals = {
      {"N not whole tiles", with(down, [](auto& g) { g.n = 200; }), S::kInternal, "not a positive multiple of 128"},
      {"K not whole k-blocks", with(down, [](auto& g) { g.k = 100; }), S::kInternal, "K = 100"},
      {"m not whole tiles", with(wgrad, [](auto& g) { g.m = 100; }), S::kInternal, "m = 100"},
      {"rows first in kWeightGrad", with(wgrad, [](auto& g) { g.tile_order = TileOrder::kRowsFirst; }),
       S::kInvalidArgument, "rows-first"},
      {"B transposed in kDown", with(down, [](auto& g) { g.b_transposed = true; }), S::kInternal,
       "B transposed is for kDownGrad"},
      {"bf16 B transposed", with(dgrad, [](auto& g) { g.b_transposed = true; }), S::kUnimplemented,
       "bf16 reads B as given"},
      {"FP8 B transposed misshapen", with(dgrad8, [](auto& g) { g.b.cols = 128; }), S::kInternal,
       "B transposed is [E * n, k]"},
      {"FP8 data gradient with B as given", with(dgrad8, [](auto& g) { g.b_transposed = false; }),
       S::kInvalidArgument, "give B transposed"},
      {"FP8 held rows", with(up8, [](auto& g) { g.arrival.rows_ready = static_cast<const uint32_t*>(fake(22)); }),
       S::kUnimplemented, "FP8 with held rows"},
      {"FP8 kGateUp n != I", with(up8, [](auto& g) { g.n = 128; }), S::kInternal, "n = I"},
      {"FP8 scales missing", with(up8, [](auto& g) { g.a.scales = nullptr; }), S::kInternal, "A's and B's scales"},
      {"FP8 B rows not whole blocks", with(up8, [](auto& g) { g.b.rows -= 64; }), S::kInternal, "whole 128-row"},
      {"FP8 A's columns not k", with(up8, [](auto& g) { g.a.cols = 128; }), S::kInternal, "must have k columns"},
      {"FP8 kWeightGrad pool rows", with(wgrad8, [](auto& g) { g.a.cols = g.b.cols = 100; }), S::kInternal,
       "whole 128-row blocks"},
      {"FP8 kWeightGrad shapes", with(wgrad8, [](auto& g) { g.a.rows = 128; }), S::kInvalidArgument, "A^T [m, C]"},
      {"FP8 kWeightGrad scales unaligned",
       with(wgrad8, [](auto& g) { g.a.scales = static_cast<const float*>(fake(23)) + 1; }), S::kInvalidArgument,
       "16-byte aligned"},
      {"held rows in kDown", with(down, [](auto& g) { g.arrival.rows_ready = static_cast<const uint32_t*>(fake(22)); }),
       S::kUnimplemented, "built for bf16 kGateUp only"},
      {"held rows waiting for nothing", with(own, [](auto& g) { g.arrival.ready_value = 0; }), S::kInternal,
       "ready_value 0"},
      {"side combine in kGateUp", with(up, [&](auto& g) { g.side_combine = dx_side_combine(c, b, nullptr, fake(16)); }),
       S::kInvalidArgument, "bf16 kWeightGrad"},
      {"side combine past the tokens", with(wgrad, [&](auto& g) {
         g.side_combine = dx_side_combine(c, b, static_cast<const int32_t*>(fake(13)), fake(16));
         g.side_combine.end = g.side_combine.tokens + 1;
       }),
       S::kInvalidArgument, "0 <= begin <= end <= tokens"},
      {"side gather counts without a gather", with(up, [](auto& g) { g.side_gather.rows_ready = static_cast<uint32_t*>(fake(22)); }),
       S::kInvalidArgument, "rows_ready without a side gather"},
      {"side gather in kDown", with(down, [&](auto& g) { g.side_gather = own.side_gather; }), S::kInvalidArgument,
       "bf16 kGateUp, kGateUpGrad and kWeightGrad"},
      {"kGateUp's own gather into another pool", with(own, [](auto& g) { g.side_gather.pool = fake(24); }),
       S::kInvalidArgument, "fills its A"},
      {"side gather width", with(own, [](auto& g) { g.side_gather.width = 100; g.a.cols = 100; }),
       S::kInvalidArgument, "multiple of 8"},
      {"side scatter with counts", with(gate_up_grad_gemm(c, b, fake(10), nullptr, fake(15)), [](auto& g) {
         g.side_gather.rows_ready = static_cast<uint32_t*>(fake(22));
       }),
       S::kInvalidArgument, "no rows_ready"},
      {"peer slots in kDownGrad", with(dgrad, [](auto& g) { g.out.peer_slots.rank_buffers = static_cast<void* const*>(fake(21)); }),
       S::kInternal, "slot-writing modes"},
      {"peer slots without counts", with(down, [](auto& g) { g.out.peer_slots.rank_buffers = static_cast<void* const*>(fake(21)); }),
       S::kInternal, "token counts"},
      {"peer slots over 8 ranks", with(down, [](auto& g) {
         g.out.peer_slots.rank_buffers = static_cast<void* const*>(fake(21));
         g.out.peer_slots.source_counts = static_cast<const int64_t*>(fake(20));
         g.out.peer_slots.tokens_per_rank = 30;
       }),
       S::kInternal, "1 to 8 ranks"},
      {"dz in e4m3 in kDown", with(down, [](auto& g) { g.out.dz_q = static_cast<uint8_t*>(fake(25)), g.out.dz_s = static_cast<float*>(fake(26)); }),
       S::kInvalidArgument, "dz in e4m3"},
      {"pool-order rows in kGateUpGrad", with(xgrad, [](auto& g) { g.out.pool_rows = fake(24); }), S::kInvalidArgument,
       "pool-order rows are kDown's"},
      {"kWeightGrad output unaligned", with(wgrad, [](auto& g) { g.out.dw = static_cast<char*>(fake(18)) + 8; }),
       S::kInternal, "16-byte (fp32)"},
  };
  for (const Refusal& r : refusals) {
    KernelConfig cfg;
    const Status st = select_kernel(r.args, kSms, {}, &cfg);
    EXPECT_EQ(st.code(), r.code) << r.what << ": " << st.to_string();
    EXPECT_NE(st.message().find(r.words), std::string::npos) << r.what << ": " << st.to_string();
  }
  // Pool-order rows need the 128 x 256 tiles.
  GroupedGemmArgs pool = down;
  pool.out.slots = nullptr, pool.out.pool_rows = fake(24);
  GemmOverrides narrow;
  narrow.narrow_tiles = true;
  KernelConfig cfg;
  const Status st = select_kernel(pool, kSms, narrow, &cfg);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_EQ(select_kernel(down, 0, {}, &cfg).code(), StatusCode::kInternal) << "no SMs";
}

}  // namespace
}  // namespace megamoe::cuda
