#include "cuda/gemm/kernel_config.h"

#include <cstdint>
#include <string>

#include "cuda/plan/device_plan.h"

namespace megamoe::cuda {
namespace {

using engine::KernelKey;
using engine::RowHold;
using engine::TileShape;

bool m_grouped(GemmMode m) { return m != GemmMode::kWeightGrad; }
bool misaligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes != 0; }

// Sizes every mode needs: whole tiles along N (kGateUp: whole 64-column gate and up halves) and K.
Status check_sizes(const GroupedGemmArgs& a) {
  if (a.n <= 0 || (a.n % kBlockN != 0 && a.mode != GemmMode::kGateUp) || a.n % 64 != 0)
    return internal_error("grouped GEMM: N = " + std::to_string(a.n) + " is not a positive multiple of 128");
  if (m_grouped(a.mode) && (a.k <= 0 || a.k % kBlockK != 0))
    return internal_error("grouped GEMM: K = " + std::to_string(a.k) + " is not a positive multiple of 64");
  if (a.mode == GemmMode::kWeightGrad && (a.m <= 0 || a.m % kBlockM != 0))
    return internal_error("grouped GEMM: kWeightGrad's m = " + std::to_string(a.m) + " is not a multiple of 128");
  if (a.tile_order == TileOrder::kRowsFirst && !m_grouped(a.mode))
    return invalid_argument("grouped GEMM: rows-first orders the M-grouped modes' tiles, not kWeightGrad's");
  if (a.b_transposed && (a.mode != GemmMode::kDownGrad && a.mode != GemmMode::kGateUpGrad))
    return internal_error("grouped GEMM: B transposed is for kDownGrad and kGateUpGrad (the others read K-major B "
                          "already, or both operands MN-major)");
  if (a.b_transposed && a.elem != ElemType::kE4M3)
    return unimplemented("grouped GEMM: bf16 reads B as given (MN-major); the transposed B is FP8's");
  if (a.b_transposed && (a.b.cols != a.k || a.b.rows % a.n != 0))
    return internal_error("grouped GEMM: B transposed is [E * n, k]");
  return Status::Ok();
}

// FP8 (e4m3 operands, the recipe's block scales).
Status check_fp8(const GroupedGemmArgs& a) {
  if (a.elem != ElemType::kE4M3) return Status::Ok();
  const bool data_grad = a.mode == GemmMode::kDownGrad || a.mode == GemmMode::kGateUpGrad;
  if (data_grad && !a.b_transposed)
    return invalid_argument("grouped GEMM: FP8 kDownGrad / kGateUpGrad read B K-major: give B transposed (the block "
                            "quantizer's transposed copy) with b.scales [E, k / 128, n / 128]");
  if (a.arrival.rows_ready != nullptr) return unimplemented("grouped GEMM: FP8 with held rows is not built");
  if (a.k % engine::kBlockKFp8 != 0) return internal_error("grouped GEMM: FP8 needs K a multiple of 128");
  if (a.mode == GemmMode::kGateUp && (a.intermediate % 128 != 0 || a.n != a.intermediate))
    return internal_error("grouped GEMM: FP8 kGateUp needs I a multiple of 128 and n = I, the a columns (gate and up "
                          "in whole scale blocks; its consumers take column tiles in pairs)");
  if (a.a.scales == nullptr || a.b.scales == nullptr) return internal_error("grouped GEMM: FP8 needs A's and B's scales");
  if (a.b.rows % 128 != 0) return internal_error("grouped GEMM: FP8's B rows must be whole 128-row scale blocks");
  if (a.mode == GemmMode::kWeightGrad) {
    if (a.a.cols % 128 != 0)
      return internal_error("grouped GEMM: FP8 kWeightGrad needs the pool rows to be whole 128-row blocks");
    if (a.a.rows != a.m || a.b.rows != a.n || a.a.cols != a.b.cols)
      return invalid_argument("grouped GEMM: FP8 kWeightGrad reads A^T [m, C] and B^T [n, C] (quantize_e4m3_cols_t's "
                              "q_t), with scales [C / 128, m] and [C / 128, n]");
    if (misaligned(a.a.scales, 16) || misaligned(a.b.scales, 16))
      return invalid_argument("grouped GEMM: FP8 kWeightGrad's scales must be 16-byte aligned (bulk copies)");
  } else if (a.a.cols != a.k || (!a.b_transposed && a.b.cols != a.k)) {
    return internal_error("grouped GEMM: FP8's A (and a K-major B) must have k columns (their scales are k / 128 wide)");
  }
  return Status::Ok();
}

// Held rows: bf16 kGateUp's tiles wait on their counters.
Status check_arrival(const GroupedGemmArgs& a) {
  if (a.arrival.rows_ready == nullptr) return Status::Ok();
  if (a.mode != GemmMode::kGateUp || a.elem != ElemType::kBF16)
    return unimplemented(std::string("grouped GEMM: held rows are built for bf16 kGateUp only, not ") +
                         to_string(a.mode) + (a.elem == ElemType::kE4M3 ? " in FP8" : ""));
  if (a.arrival.ready_value == 0) return internal_error("grouped GEMM: held rows with ready_value 0 would wait for nothing");
  return Status::Ok();
}

Status check_side_combine(const GroupedGemmArgs& a) {
  const SideCombine& s = a.side_combine;
  if (s.out == nullptr) return Status::Ok();
  if (a.mode != GemmMode::kWeightGrad || a.elem != ElemType::kBF16)
    return invalid_argument("grouped GEMM: the side combine runs in the bf16 kWeightGrad kernels");
  if (s.slots == nullptr || s.topk_idx == nullptr || s.error_key == nullptr || s.begin < 0 || s.begin > s.end ||
      s.end > s.tokens || s.slot_tokens < s.tokens || s.top_k < 1 || s.top_k > kMaxTopK || s.num_experts < 1 ||
      s.hidden <= 0 || s.hidden % 8 != 0 || s.hidden / 8 > INT32_MAX)
    return invalid_argument("grouped GEMM: the side combine needs slots, topk_idx and error_key, 0 <= begin <= end <= "
                            "tokens <= slot_tokens, top_k 1..32, num_experts >= 1 and hidden a positive multiple of 8");
  return Status::Ok();
}

Status check_side_gather(const GroupedGemmArgs& a) {
  const SideGather& s = a.side_gather;
  if (s.pool == nullptr)
    return s.rows_ready == nullptr ? Status::Ok()
                                   : invalid_argument("grouped GEMM: side_gather.rows_ready without a side gather");
  if (a.mode == GemmMode::kDown || a.mode == GemmMode::kDownGrad || a.elem != ElemType::kBF16)
    return invalid_argument("grouped GEMM: the side gather runs in the bf16 kGateUp, kGateUpGrad and kWeightGrad "
                            "kernels");
  // kGateUp gathers its own A, its tiles held on the gather's counts; elsewhere it fills a pool the GEMM does not read.
  const bool own_a = a.mode == GemmMode::kGateUp;
  if (own_a != (s.rows_ready != nullptr) ||
      (own_a && (s.pool != a.a.data || a.arrival.rows_ready != s.rows_ready || a.arrival.ready_value != 128 ||
                 s.pool_rows != a.plan.pool_rows || s.row_src != a.plan.row_src || s.top_k != a.plan.top_k ||
                 s.width != a.a.cols)))
    return invalid_argument("grouped GEMM: the side gather in kGateUp fills its A (pool == a, the plan's rows, width "
                            "a.cols) and counts its rows into rows_ready, which the kernel holds its tiles on (the "
                            "arrival's counters, ready_value 128); elsewhere it has no rows_ready");
  if (s.src == nullptr || s.row_src == nullptr || s.pool_rows == nullptr || s.top_k < 1 || s.width <= 0 ||
      s.width % 8 != 0 || s.width / 8 > INT32_MAX)
    return invalid_argument("grouped GEMM: the side gather needs src, row_src and pool_rows, top_k >= 1 and width a "
                            "positive multiple of 8");
  if (s.route_row != nullptr &&
      (s.rows_ready != nullptr || s.top_k > kMaxTopK || s.tokens < 0 || s.tokens * s.top_k > INT32_MAX))
    return invalid_argument("grouped GEMM: the side gather as a scatter (route_row) has no rows_ready (its rows come "
                            "in token order), top_k <= 32 and tokens * top_k within int32");
  return Status::Ok();
}

Status check_peer_slots(const GroupedGemmArgs& a) {
  const PeerSlots& ps = a.out.peer_slots;
  if (ps.rank_buffers == nullptr) return Status::Ok();
  if (a.mode != GemmMode::kDown && a.mode != GemmMode::kGateUpGrad)
    return internal_error("grouped GEMM: peer slots are for the slot-writing modes (kDown, kGateUpGrad)");
  if (ps.source_counts == nullptr) return internal_error("grouped GEMM: peer slots need the sources' token counts");
  if (a.plan.num_tokens > 0 && (ps.tokens_per_rank <= 0 || a.plan.num_tokens % ps.tokens_per_rank != 0 ||
                                a.plan.num_tokens / ps.tokens_per_rank > 8))
    return internal_error("grouped GEMM: peer_slots.tokens_per_rank must split the plan's virtual tokens into 1 to 8 "
                          "ranks");
  if (ps.offset % 16 != 0 || (a.n * 2) % 16 != 0)
    return internal_error("grouped GEMM: peer slot rows must be 16-byte aligned (16-byte stores)");
  return Status::Ok();
}

Status check_outputs(const GroupedGemmArgs& a) {
  const GemmOutputs& o = a.out;
  if (o.dz_q != nullptr && (a.mode != GemmMode::kDownGrad || a.intermediate % 128 != 0 || a.n != a.intermediate ||
                            o.dz_s == nullptr || misaligned(o.dz_q, 8) || misaligned(o.dz_s, 4)))
    return invalid_argument("grouped GEMM: dz in e4m3 from the epilogue is for kDownGrad with I a multiple of 128, "
                            "dz_s given, dz_q 8-byte and dz_s 4-byte aligned");
  if (o.pool_rows != nullptr && (a.mode != GemmMode::kDown || o.slots != nullptr || o.peer_slots.rank_buffers != nullptr))
    return invalid_argument("grouped GEMM: pool-order rows are kDown's, instead of slots (none given, no peer slots)");
  if (a.mode == GemmMode::kWeightGrad && misaligned(o.dw, o.dw_f32 ? 16 : 8))
    return internal_error("grouped GEMM: kWeightGrad's output must be 16-byte (fp32) or 8-byte (bf16) aligned "
                          "(4-column stores)");
  return Status::Ok();
}

// 128 x 256 tiles (bf16) wherever they apply: kGateUp with whole 128-column
// blocks of gate and of up; kDown, kGateUpGrad and kWeightGrad with N % 256
// == 0, the slot writers into this GPU's slots only (peer slots keep the
// 128 x 128 tiles); kDownGrad never (its z chunks leave them too few stages).
TileShape choose_tile(const GroupedGemmArgs& a, const GemmOverrides& o) {
  if (a.elem != ElemType::kBF16 || o.narrow_tiles) return TileShape::k128x128;
  const bool local_slots = a.out.peer_slots.rank_buffers == nullptr;
  bool wide = false;
  switch (a.mode) {
    case GemmMode::kGateUp: wide = a.intermediate % 128 == 0 && a.n % 128 == 0; break;
    case GemmMode::kDown:
    case GemmMode::kGateUpGrad: wide = a.n % 256 == 0 && local_slots; break;
    case GemmMode::kWeightGrad: wide = a.n % 256 == 0; break;
    case GemmMode::kDownGrad: break;
  }
  return wide ? TileShape::k128x256 : TileShape::k128x128;
}

const char* to_string(ElemType e) { return e == ElemType::kE4M3 ? "e4m3" : "bf16"; }

int smem_of(KernelKey key) {
  int bytes = 0;
  engine::for_each_built_kernel([&](auto spec) {
    using Spec = decltype(spec);
    if (Spec::kKey == key) bytes = engine::smem_bytes<Spec>();
  });
  return bytes;
}

}  // namespace

const char* to_string(GemmMode m) {
  static const char* const kNames[] = {"kGateUp", "kDown", "kDownGrad", "kGateUpGrad", "kWeightGrad"};
  const auto i = static_cast<size_t>(m);
  return i < sizeof(kNames) / sizeof(kNames[0]) ? kNames[i] : "?";
}

std::string KernelConfig::describe() const {
  std::string s = std::string(to_string(key.mode)) + " " + to_string(key.elem) +
                  (key.tile == TileShape::k128x256 ? " 128x256" : " 128x128");
  if (key.hold == RowHold::kWaitForRows) s += " held-rows";
  if (split_rings) s += " split-rings";
  if (paired_columns) s += " paired-columns";
  if (tile_order == TileOrder::kRowsFirst) s += " rows-first";
  if (cooperative) s += " cooperative";
  return stages > 0 ? s + ", " + std::to_string(stages) + " stages" : s;
}

Status select_kernel(const GroupedGemmArgs& a, int num_sms, const GemmOverrides& o, KernelConfig* out) {
  // Each feature's preconditions, beside the feature: the first rule broken is the error.
  for (Status (*check)(const GroupedGemmArgs&) :
       {check_sizes, check_fp8, check_arrival, check_side_combine, check_side_gather, check_peer_slots, check_outputs})
    MEGAMOE_RETURN_IF_ERROR(check(a));
  if (num_sms < 1) return internal_error("grouped GEMM: no SMs to launch on");
  KernelConfig c;
  c.key = KernelKey{a.mode, a.elem, choose_tile(a, o),
                    a.arrival.rows_ready != nullptr ? RowHold::kWaitForRows : RowHold::kNone};
  if (!engine::kernel_is_built(c.key))
    return unimplemented("grouped GEMM: " + c.describe() + " is not built (kernel_spec.h's kBuiltKernels)");
  const bool wide = c.key.tile == TileShape::k128x256, fp8 = a.elem == ElemType::kE4M3;
  if (a.out.pool_rows != nullptr && !wide)
    return invalid_argument("grouped GEMM: pool-order rows are written by bf16 kDown in 128 x 256 tiles (n a multiple "
                            "of 256)");
  const bool wgrad = a.mode == GemmMode::kWeightGrad;
  c.a_major = wgrad && !fp8 ? Majorness::kMnMajor : Majorness::kKMajor;
  c.b_major = !fp8 && a.mode != GemmMode::kGateUp && a.mode != GemmMode::kDown ? Majorness::kMnMajor
                                                                               : Majorness::kKMajor;
  c.split_rings = fp8;
  c.paired_columns = fp8 && a.mode == GemmMode::kGateUp;
  c.scale_ring = fp8 && wgrad;
  c.cooperative = a.side_gather.rows_ready != nullptr;
  c.tile_order = a.tile_order;
  c.stages = engine::stage_count(c.key);
  c.grid = num_sms;
  c.smem_bytes = smem_of(c.key);
  c.n_tiles = static_cast<int>(a.mode == GemmMode::kGateUp ? a.n / (wide ? 128 : 64) : a.n / (wide ? 256 : kBlockN));
  c.m_tiles = static_cast<int>(a.m / kBlockM);
  c.k_blocks = static_cast<int>(a.k / (fp8 ? engine::kBlockKFp8 : kBlockK));
  *out = c;
  return Status::Ok();
}

}  // namespace megamoe::cuda
