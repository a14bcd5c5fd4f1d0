// The grouped GEMM's kernel, decided once on the host as a value: which
// instantiation (kernel_spec.h's KernelKey) and what follows from it, chosen
// by select_kernel from the arguments and the device, with each feature's
// preconditions checked beside the feature (a refusal names the rule).
// launch_grouped_gemm launches what this selects; tests/cpu/kernel_config_test
// runs the selection for every GEMM the layer makes.
#pragma once

#include <string>

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/kernel_spec.h"

namespace megamoe::cuda {

enum class Majorness { kKMajor, kMnMajor };

struct KernelConfig {
  engine::KernelKey key{GemmMode::kGateUp, ElemType::kBF16, engine::TileShape::k128x128, engine::RowHold::kNone};
  Majorness a_major = Majorness::kKMajor, b_major = Majorness::kKMajor;  // in shared memory, as wgmma reads them
  bool split_rings = false;     // one stage ring per consumer (FP8)
  bool paired_columns = false;  // FP8 kGateUp: the consumers take column tiles 2j, 2j + 1 together
  bool scale_ring = false;      // FP8 kWeightGrad: each k-block's scales come with its stage
  bool cooperative = false;     // every CTA resident at once (tiles held on the kernel's own side gather)
  TileOrder tile_order = TileOrder::kColumnsFirst;
  int stages = 0;               // ring stages (split rings: both)
  int grid = 0;                 // CTAs (persistent: one per SM)
  int smem_bytes = 0;           // dynamic shared memory of the launch
  int n_tiles = 0;              // output column tiles (kGateUp: of a's columns)
  int m_tiles = 0;              // kWeightGrad: row tiles of dW[e]
  int k_blocks = 0;             // M-grouped: k-blocks of K (64 bf16 or 128 e4m3 elements)
  std::string describe() const;  // "kDown bf16 128x256 ..."
};

const char* to_string(GemmMode m);

// The kernel for `args` on a GPU of `num_sms` SMs, or the rule the arguments
// break (InvalidArgument), or the instantiation they would need that is not
// built (Unimplemented).
Status select_kernel(const GroupedGemmArgs& args, int num_sms, const GemmOverrides& overrides, KernelConfig* out);

}  // namespace megamoe::cuda
