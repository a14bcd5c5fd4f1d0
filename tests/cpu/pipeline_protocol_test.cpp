// A CPU model of the grouped GEMM engine's pipeline protocol (one CTA: the
// producer, the TMA unit completing loads in any order, two ping-pong
// consumers), driven by the kernel's own arithmetic (cuda/gemm/pipeline_state.h)
// under random interleavings. Checked: every stage a consumer's wait lets it
// read holds the iteration it expects (never an older or newer load), and the
// CTA always finishes (no deadlock). The model without order barriers must
// fail the first check: the test can fail. The same for the FP8 kernels'
// split rings (one ring per consumer), and for wide kGateUp tiles (both
// consumers on every stage, each stage freed by both).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/gemm/pipeline_state.h"

namespace {

using megamoe::cuda::engine::order_must_wait;
using megamoe::cuda::engine::order_parity;
using megamoe::cuda::engine::PipelineState;

// An mbarrier: a phase completes when `count` arrivals have come.
// try_wait(parity) is PTX's: true once the phase with that parity has
// completed (the phase before the first counts as completed).
struct Barrier {
  int count = 1;
  int arrivals = 0;
  uint32_t completed = 0;
  bool try_wait(uint32_t parity) const { return (completed & 1u) != parity; }
  void arrive() {
    if (++arrivals == count) arrivals = 0, ++completed;
  }
};

struct TileWork {
  int k_blocks;
};

// The TMA unit: one in-flight load, picked at random, lands: its stage holds
// the load's tag and the stage's full barrier gets its arrival. A stage that
// a consumer's wgmmas may still be reading (held(s)) must not be written.
template <typename Tag, int S, typename Held>
bool land_one_load(std::vector<std::pair<int, Tag>>& in_flight, int64_t (&content)[S], Barrier (&full)[S],
                   std::mt19937& rng, Held held, std::string& violation) {
  if (in_flight.empty()) return false;
  const size_t i = rng() % in_flight.size();
  const auto [s, tag] = in_flight[i];
  in_flight.erase(in_flight.begin() + static_cast<long>(i));
  if (held(s) && violation.empty())
    violation = "a load landed in stage " + std::to_string(s) + " while a consumer's wgmmas may still read it";
  content[s] = tag;
  full[s].arrive();
  return true;
}

template <int S>
struct Cta {
  std::vector<TileWork> tiles;
  bool use_order = true;
  // Wide kGateUp tiles (128 x 256): both consumers read every
  // stage of every tile, no order barriers, and a stage's empty barrier
  // counts both consumers (one arrival each here: the kernel's 4 + 4 warps).
  bool wide = false;
  // A consumer's wgmmas read a stage from their issue until the next
  // k-block's wait<1> (or the tile's wait<0>) retires them: held[s] counts
  // the consumers doing so. early_release (a spoiled model) gives a stage
  // back right after issuing its wgmmas, before they retire.
  int held[S] = {};
  bool early_release = false;
  Barrier full[S], empty[S], order[2];
  int64_t content[S];  // the iteration whose data the stage holds (-1: none)
  std::vector<std::pair<int, uint32_t>> in_flight;  // loads issued, not yet landed: (stage, iteration)
  std::string violation;

  // Producer.
  size_t p_tile = 0;
  int p_step = 0;  // stage of the current tile
  PipelineState<S> p_ps;
  // Consumers.
  struct Consumer {
    size_t tile = 0;
    int step = -1;  // -1: before the order wait; [0, k): main loop; k: epilogue
    int mine = 0;
    PipelineState<S> ps;
  } c[2];

  Cta() {
    for (int s = 0; s < S; ++s) full[s].count = 1, empty[s].count = 1, content[s] = -1;
  }

  bool done() const {
    return p_tile == tiles.size() && in_flight.empty() && c[0].tile >= tiles.size() && c[1].tile >= tiles.size();
  }

  // One step of the producer; false when it is blocked or done.
  bool producer_step() {
    while (p_tile < tiles.size() && tiles[p_tile].k_blocks == 0) ++p_tile;  // no loads
    if (p_tile == tiles.size()) return false;
    const TileWork& t = tiles[p_tile];
    if (!empty[p_ps.stage()].try_wait(p_ps.empty_parity())) return false;
    in_flight.emplace_back(p_ps.stage(), p_ps.it);
    ++p_ps;
    if (++p_step == t.k_blocks) p_step = 0, ++p_tile;
    return true;
  }

  // The TMA unit: one in-flight load lands.
  bool tma_step(std::mt19937& rng) {
    return land_one_load(in_flight, content, full, rng, [&](int s) { return held[s] > 0; }, violation);
  }

  bool read_stage(PipelineState<S> ps, const char* what) {
    if (!full[ps.stage()].try_wait(ps.parity())) return false;
    if (content[ps.stage()] != ps.it && violation.empty())
      violation = std::string(what) + ": iteration " + std::to_string(ps.it) + " read stage " +
                  std::to_string(ps.stage()) + " holding iteration " + std::to_string(content[ps.stage()]);
    return true;
  }

  // One step of consumer cw; false when it is blocked or done.
  bool consumer_step(int cw) {
    Consumer& me = c[cw];
    // Skip the other consumer's tiles (the kernel walks them to keep `it` in step).
    while (!wide && me.tile < tiles.size() && static_cast<int>(me.tile & 1) != cw) {
      me.ps.advance(static_cast<uint32_t>(tiles[me.tile].k_blocks));
      ++me.tile;
    }
    if (me.tile >= tiles.size()) return false;
    const TileWork& t = tiles[me.tile];
    if (me.step == -1) {
      if (!wide && use_order && order_must_wait(cw, me.mine) && !order[cw].try_wait(order_parity(cw, me.mine)))
        return false;
      ++me.mine;
      me.step = 0;
      return true;
    }
    if (me.step < t.k_blocks) {
      if (!read_stage(me.ps, "main loop")) return false;
      ++held[me.ps.stage()];  // this k-block's wgmmas are issued
      if (me.step > 0) {  // the previous k-block's wgmma group retired (wait<1>): its stage goes back
        --held[me.ps.previous_stage()];
        if (!early_release) empty[me.ps.previous_stage()].arrive();
      }
      if (early_release) empty[me.ps.stage()].arrive();
      ++me.ps;
      ++me.step;
      if (me.step == t.k_blocks && t.k_blocks > 0) {  // wait<0>: the last group retired
        --held[me.ps.previous_stage()];
        if (!early_release) empty[me.ps.previous_stage()].arrive();
      }
      return true;
    }
    // Epilogue: let the other consumer start its main loop, next tile.
    if (!wide) order[cw ^ 1].arrive();
    me.step = -1;
    ++me.tile;
    return true;
  }

};

// Runs a CTA model (Cta, SplitCta) to the end under a random interleaving of
// its producer, TMA unit and two consumers; false on deadlock.
template <typename Model>
bool run_model(Model& cta, std::mt19937& rng) {
  for (int guard = 0; guard < 1000000; ++guard) {
    if (cta.done()) return true;
    bool moved = false;
    for (int attempt = 0; attempt < 8 && !moved; ++attempt) {
      switch (rng() % 4) {
        case 0: moved = cta.producer_step(); break;
        case 1: moved = cta.tma_step(rng); break;
        case 2: moved = cta.consumer_step(0); break;
        default: moved = cta.consumer_step(1); break;
      }
    }
    if (!moved) moved = cta.producer_step() || cta.tma_step(rng) || cta.consumer_step(0) || cta.consumer_step(1);
    if (!moved) return cta.done();
  }
  return false;
}

template <int S>
std::vector<TileWork> random_tiles(std::mt19937& rng) {
  std::vector<TileWork> tiles(rng() % 10);
  for (TileWork& t : tiles) t = {static_cast<int>(rng() % (3 * S + 1))};
  return tiles;
}

// Random tile lists on 3000 seeds: every run ends, and every read sees the load it expects.
template <typename Model, int S>
void check_model() {
  for (uint32_t seed = 0; seed < 3000; ++seed) {
    std::mt19937 rng(seed);
    Model cta;
    cta.tiles = random_tiles<S>(rng);
    ASSERT_TRUE(run_model(cta, rng)) << "deadlock, seed " << seed;
    ASSERT_EQ(cta.violation, "") << "seed " << seed;
  }
}

// Whether a model broken by `spoil` reports a violation on some interleaving
// (random tiles and schedules, up to 3000 seeds): the model can fail.
template <typename Model, int S, typename Spoil>
bool some_interleaving_violates(Spoil spoil) {
  for (uint32_t seed = 0; seed < 3000; ++seed) {
    std::mt19937 rng(seed);
    Model cta;
    spoil(cta);
    cta.tiles = random_tiles<S>(rng);
    run_model(cta, rng);
    if (!cta.violation.empty()) return true;
  }
  return false;
}

// The ring depths the modes use (ModeTraits::kStages).
TEST(PipelineProtocol, FourStagesEveryReadSeesItsOwnLoad) { check_model<Cta<4>, 4>(); }
TEST(PipelineProtocol, FiveStagesEveryReadSeesItsOwnLoad) { check_model<Cta<5>, 5>(); }
TEST(PipelineProtocol, SixStagesEveryReadSeesItsOwnLoad) { check_model<Cta<6>, 6>(); }

// Wide kGateUp tiles: 4 or 3 stages (kWideStages), each freed by both consumers.
template <int S>
struct WideCta : Cta<S> {
  WideCta() {
    this->wide = true;
    for (Barrier& e : this->empty) e.count = 2;
  }
};
TEST(PipelineProtocol, WideTilesEveryReadSeesItsOwnLoad) {
  check_model<WideCta<4>, 4>();
  check_model<WideCta<3>, 3>();
}

// A stage freed by the first consumer to finish with it is refilled while the
// other may not have read it yet: the model must catch that.
TEST(PipelineProtocol, WideTilesFreedByOneConsumerAStaleReadIsFound) {
  EXPECT_TRUE((some_interleaving_violates<WideCta<4>, 4>([](WideCta<4>& cta) {
    for (Barrier& e : cta.empty) e.count = 1;
  })));
}

// A stage given back before the wgmmas reading it retire can be refilled
// under them: the model must catch it, on the ping-pong ring and the wide one.
TEST(PipelineProtocol, AStageFreedBeforeItsWgmmasRetireIsFound) {
  EXPECT_TRUE((some_interleaving_violates<Cta<4>, 4>([](Cta<4>& cta) { cta.early_release = true; })));
  EXPECT_TRUE((some_interleaving_violates<WideCta<4>, 4>([](WideCta<4>& cta) { cta.early_release = true; })));
}

// Without the order barriers a consumer can poll a stage two phases ahead and
// read an older load: the model must catch it on some interleaving.
TEST(PipelineProtocol, WithoutOrderBarriersAStaleReadIsFound) {
  EXPECT_TRUE((some_interleaving_violates<Cta<4>, 4>([](Cta<4>& cta) { cta.use_order = false; })));
}

// Split rings (the FP8 kernels, pipeline.cuh): consumer c's ring is slots
// [c S / 2, c S / 2 + S / 2) and its tiles every other one of the CTA's; the
// producer is one thread per ring, each loading its ring's tiles in order
// (the kernel's since session 27); no order barriers. A stage holds a (ring,
// iteration) tag.
template <int S>
struct SplitCta {
  static constexpr int R = S / 2;
  std::vector<TileWork> tiles;
  bool separate = true;  // false: both rings on slots [0, R) (the test below must catch it)
  Barrier full[S], empty[S];
  int64_t content[S];
  std::vector<std::pair<int, int64_t>> in_flight;  // (slot, tag)
  std::string violation;
  struct Cursor {
    size_t t;  // index into tiles: ring c serves c, c + 2, ...
    int kb = 0;
    PipelineState<R> ps;
  } pc[2] = {{0, 0, {}}, {1, 0, {}}}, cc[2] = {{0, 0, {}}, {1, 0, {}}};

  SplitCta() {
    for (int s = 0; s < S; ++s) content[s] = -1;
  }
  int slot(int ring, const PipelineState<R>& ps) const { return (separate ? ring * R : 0) + ps.stage(); }
  static int64_t tag(int ring, uint32_t it) { return ring * 1000000 + it; }
  bool has(const Cursor& c) const { return c.t < tiles.size(); }
  void skip_empty(Cursor& c) {
    while (has(c) && tiles[c.t].k_blocks == 0) c.t += 2;
  }
  bool done() const { return !has(pc[0]) && !has(pc[1]) && in_flight.empty() && !has(cc[0]) && !has(cc[1]); }

  // The two producer threads: one load by either, the one tried first alternating from step to step (the
  // model's scheduler picks the steps; a producer that cannot go waits).
  int producer_turn = 0;
  bool producer_step() {
    producer_turn ^= 1;
    for (int ring : {producer_turn, producer_turn ^ 1}) {
      Cursor& c = pc[ring];
      skip_empty(c);
      if (!has(c) || !empty[slot(ring, c.ps)].try_wait(c.ps.empty_parity())) continue;
      in_flight.emplace_back(slot(ring, c.ps), tag(ring, c.ps.it));
      ++c.ps;
      if (++c.kb == tiles[c.t].k_blocks) c.kb = 0, c.t += 2;
      return true;
    }
    return false;
  }

  // (Split rings release a stage after wait<0>, within the consumer's step: nothing is held across steps.)
  bool tma_step(std::mt19937& rng) {
    return land_one_load(in_flight, content, full, rng, [](int) { return false; }, violation);
  }

  // Consumer cw: a k-block per step (waits for its stage, checks it, gives it back); a tile without k-blocks
  // is its epilogue alone.
  bool consumer_step(int cw) {
    Cursor& c = cc[cw];
    if (!has(c)) return false;
    if (tiles[c.t].k_blocks == 0) return c.t += 2, true;
    const int s = slot(cw, c.ps);
    if (!full[s].try_wait(c.ps.parity())) return false;
    if (content[s] != tag(cw, c.ps.it) && violation.empty())
      violation = "ring " + std::to_string(cw) + " iteration " + std::to_string(c.ps.it) + " read slot " +
                  std::to_string(s) + " holding tag " + std::to_string(content[s]);
    empty[s].arrive();
    ++c.ps;
    if (++c.kb == tiles[c.t].k_blocks) c.kb = 0, c.t += 2;
    return true;
  }

};

// The FP8 kernels' depths: 4 (kGateUp, kDown, kGateUpGrad), 5 (kDownGrad: one
// slot unused) and 6 (kWeightGrad) stages.
TEST(PipelineProtocol, SplitRingsEveryReadSeesItsOwnLoad) {
  check_model<SplitCta<4>, 4>();
  check_model<SplitCta<5>, 5>();
  check_model<SplitCta<6>, 6>();
}

// Both rings on the same slots: a consumer reads the other ring's load.
TEST(PipelineProtocol, SplitRingsOnSharedSlotsAStaleReadIsFound) {
  EXPECT_TRUE((some_interleaving_violates<SplitCta<4>, 4>([](SplitCta<4>& cta) { cta.separate = false; })));
}

TEST(PipelineProtocol, StateArithmetic) {
  PipelineState<4> ps;
  EXPECT_EQ(ps.stage(), 0);
  EXPECT_EQ(ps.parity(), 0u);
  EXPECT_EQ(ps.empty_parity(), 1u);  // the first pass finds every stage free
  EXPECT_EQ(ps.previous_stage(), 3);
  ps.advance(5);
  EXPECT_EQ(ps.stage(), 1);
  EXPECT_EQ(ps.parity(), 1u);
  EXPECT_FALSE(order_must_wait(0, 0));
  EXPECT_TRUE(order_must_wait(1, 0));
  EXPECT_EQ(order_parity(1, 0), 0u);  // consumer 1's first tile: phase 0 of order[1]
  EXPECT_EQ(order_parity(0, 1), 0u);  // consumer 0's second tile: phase 0 of order[0]
  EXPECT_EQ(order_parity(0, 2), 1u);
}

}  // namespace
