// launch_grouped_gemm: the selected kernel (kernel_config.h), its TMA
// descriptors and its launch. The instantiations are the built list of
// kernel_spec.h, reached by a switch per dimension of the key.
#include <algorithm>
#include <atomic>
#include <string>

#include "cuda/common/cuda_status.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/kernel.cuh"
#include "cuda/gemm/kernel_config.h"
#include "cuda/gemm/tensor_map.h"

namespace megamoe::cuda {
namespace {

using engine::KernelKey;
using engine::KernelParams;
using engine::KernelSpec;
using engine::RowHold;
using engine::TileShape;

// The five descriptors a kernel takes: A and B always; the epilogues' TMA
// stores and loads where the mode has them (the others get A's, never used).
struct TmaDescriptors {
  CUtensorMap a, b, z, out0, out1;
};

Status make_descriptors(const GroupedGemmArgs& args, const KernelConfig& cfg, TmaDescriptors* d) {
  const bool fp8 = args.elem == ElemType::kE4M3;
  if (fp8) {  // e4m3: boxes of 64 rows x 128 elements, the same 128-byte rows
    MEGAMOE_RETURN_IF_ERROR(make_tma_2d_e4m3_box64x128(args.a.data, args.a.rows, args.a.cols, &d->a));
    MEGAMOE_RETURN_IF_ERROR(make_tma_2d_e4m3_box64x128(args.b.data, args.b.rows, args.b.cols, &d->b));
  } else {  // every bf16 operand as 64 x 64 boxes; the mode decides what the box dimensions mean
    MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(args.a.data, args.a.rows, args.a.cols, &d->a));
    MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(args.b.data, args.b.rows, args.b.cols, &d->b));
  }
  d->z = d->out0 = d->out1 = d->a;
  const GemmOutputs& o = args.out;
  const int64_t C = args.a.rows, I = args.intermediate;
  if (o.pool_rows != nullptr) MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(o.pool_rows, C, args.n, &d->out0));
  if (args.mode == GemmMode::kDownGrad) {  // z in; dz and wa out
    MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(o.z_in, C, 2 * I, &d->z));
    if (o.dz != nullptr) MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(o.dz, C, 2 * I, &d->out0));
    if (o.wa != nullptr) MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(o.wa, C, I, &d->out1));
  }
  if (args.mode == GemmMode::kGateUp && cfg.key.tile == TileShape::k128x256) {  // z and a out
    if (o.z != nullptr) MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(o.z, C, 2 * I, &d->out0));
    if (o.a != nullptr) MEGAMOE_RETURN_IF_ERROR(make_tma_2d_bf16_box64(o.a, C, I, &d->out1));
  }
  return Status::Ok();
}

// The register split (kernel_spec.h) shares out a pool of kLaunchRegs per
// thread; a kernel built with fewer would block in setmaxnreg for good. Asked
// once per kernel (a failed query is asked again next time).
template <typename Kernel>
Status check_registers(Kernel kernel, std::atomic<int>& known) {
  int regs = known.load(std::memory_order_relaxed);
  if (regs == 0) {
    cudaFuncAttributes a{};
    const cudaError_t q = cudaFuncGetAttributes(&a, kernel);
    if (q != cudaSuccess) return cuda_status("grouped GEMM: reading the kernel's attributes", q);
    regs = a.numRegs;
    known.store(regs, std::memory_order_relaxed);
  }
  if (regs != engine::kLaunchRegs)
    return internal_error("grouped GEMM: the kernel has " + std::to_string(regs) +
                          " registers per thread; its register split needs " + std::to_string(engine::kLaunchRegs));
  return Status::Ok();
}

template <typename Spec>
Status launch_kernel(const TmaDescriptors& d, const KernelParams& params, const KernelConfig& cfg,
                     cudaStream_t stream) {
  auto* kernel = engine::grouped_gemm_kernel<Spec>;
  static std::atomic<int> known_regs{0};
  MEGAMOE_RETURN_IF_ERROR(check_registers(kernel, known_regs));
  constexpr int kSmem = engine::smem_bytes<Spec>();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return cuda_status("grouped GEMM: setting its shared memory", err);
  // The smallest shared-memory carve-out that holds it (with the driver's 1 KB
  // a block): the rest of the SM's 256 KB is L1 (the M-grouped FP8 kernels'
  // 164-198 KB get the 196 KB carve-out, 60 KB of L1). The hint is a
  // percentage of the 228 KB maximum, which the driver rounds up to a
  // supported size, so it is given rounded down (196 KB: 85%). Only a hint:
  // a failure to set it is cleared and ignored.
  constexpr int kCarveoutPercent = engine::carveout_percent(kSmem + 1024);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, kCarveoutPercent) != cudaSuccess)
    (void)cudaGetLastError();
  cudaLaunchConfig_t lc{};
  lc.gridDim = dim3(static_cast<unsigned>(cfg.grid));
  lc.blockDim = dim3(engine::kThreads);
  lc.dynamicSmemBytes = kSmem;
  lc.stream = stream;
  cudaLaunchAttribute cooperative{};
  if (cfg.cooperative) {
    // Tiles wait for rows that the grid's own warps gather (kGateUp's side
    // gather of its A): every CTA must run at once, also beside other
    // streams' kernels (a cooperative launch; one that cannot fit fails
    // instead of waiting).
    cooperative.id = cudaLaunchAttributeCooperative;
    cooperative.val.cooperative = 1;
    lc.attrs = &cooperative;
    lc.numAttrs = 1;
  }
  err = cudaLaunchKernelEx(&lc, kernel, d.a, d.b, d.z, d.out0, d.out1, params);
  if (err == cudaErrorCooperativeLaunchTooLarge) {  // a configuration error: nothing launched, nothing sticky
    (void)cudaGetLastError();
    return unavailable("grouped GEMM: a side gather's held tiles need all " + std::to_string(cfg.grid) +
                       " CTAs resident at once, and this GPU (or its MPS share) cannot hold them");
  }
  return cuda_status("grouped GEMM launch", err);
}

// One switch per dimension of the key; only built keys instantiate a kernel.
template <GemmMode M, ElemType E, TileShape T, RowHold H>
Status launch_key(const TmaDescriptors& d, const KernelParams& p, const KernelConfig& c, cudaStream_t s) {
  if constexpr (engine::kernel_is_built(KernelKey{M, E, T, H})) {
    return launch_kernel<KernelSpec<M, E, T, H>>(d, p, c, s);
  } else {
    return internal_error("grouped GEMM: " + c.describe() + " was selected but is not built");
  }
}
template <GemmMode M, ElemType E, TileShape T>
Status switch_hold(const TmaDescriptors& d, const KernelParams& p, const KernelConfig& c, cudaStream_t s) {
  switch (c.key.hold) {
    case RowHold::kNone: return launch_key<M, E, T, RowHold::kNone>(d, p, c, s);
    case RowHold::kWaitForRows: return launch_key<M, E, T, RowHold::kWaitForRows>(d, p, c, s);
  }
  return internal_error("grouped GEMM: unknown row hold");
}
template <GemmMode M, ElemType E>
Status switch_tile(const TmaDescriptors& d, const KernelParams& p, const KernelConfig& c, cudaStream_t s) {
  switch (c.key.tile) {
    case TileShape::k128x128: return switch_hold<M, E, TileShape::k128x128>(d, p, c, s);
    case TileShape::k128x256: return switch_hold<M, E, TileShape::k128x256>(d, p, c, s);
  }
  return internal_error("grouped GEMM: unknown tile shape");
}
template <GemmMode M>
Status switch_elem(const TmaDescriptors& d, const KernelParams& p, const KernelConfig& c, cudaStream_t s) {
  switch (c.key.elem) {
    case ElemType::kBF16: return switch_tile<M, ElemType::kBF16>(d, p, c, s);
    case ElemType::kE4M3: return switch_tile<M, ElemType::kE4M3>(d, p, c, s);
  }
  return internal_error("grouped GEMM: unknown element type");
}
Status switch_mode(const TmaDescriptors& d, const KernelParams& p, const KernelConfig& c, cudaStream_t s) {
  switch (c.key.mode) {
    case GemmMode::kGateUp: return switch_elem<GemmMode::kGateUp>(d, p, c, s);
    case GemmMode::kDown: return switch_elem<GemmMode::kDown>(d, p, c, s);
    case GemmMode::kDownGrad: return switch_elem<GemmMode::kDownGrad>(d, p, c, s);
    case GemmMode::kGateUpGrad: return switch_elem<GemmMode::kGateUpGrad>(d, p, c, s);
    case GemmMode::kWeightGrad: return switch_elem<GemmMode::kWeightGrad>(d, p, c, s);
  }
  return internal_error("grouped GEMM: unknown mode");
}

}  // namespace

Status launch_grouped_gemm(const GroupedGemmArgs& args, int num_sms, cudaStream_t stream,
                           const GemmOverrides& overrides) {
  KernelConfig cfg;
  MEGAMOE_RETURN_IF_ERROR(select_kernel(args, num_sms, overrides, &cfg));
  TmaDescriptors d;
  MEGAMOE_RETURN_IF_ERROR(make_descriptors(args, cfg, &d));
  KernelParams p;
  p.args = args;
  p.n_tiles = cfg.n_tiles, p.m_tiles = cfg.m_tiles, p.k_blocks = cfg.k_blocks;
  p.stall_at = overrides.stall_at;
  p.skip_epilogue = overrides.skip_epilogue;
  return switch_mode(d, p, cfg, stream);
}

}  // namespace megamoe::cuda
