#include "megamoe/presets.h"

namespace megamoe {
namespace {

// tiny: small enough for the CPU reference in seconds, yet aligned for the CUDA
// layer (hidden and intermediate multiples of 128). The Qwen3 rows are the
// published model configurations (moe_intermediate_size, num_experts, ...).
constexpr ModelPreset kPresets[] = {
    {"tiny", 256, 128, 8, 2, 4, 2, 64},
    {"qwen3-30b-a3b", 2048, 768, 128, 8, 32, 4, 128},
    {"qwen3-235b-a22b", 4096, 1536, 128, 8, 64, 4, 128},
};
constexpr int kCount = static_cast<int>(sizeof(kPresets) / sizeof(kPresets[0]));

}  // namespace

int preset_count() { return kCount; }

const ModelPreset* preset(int index) { return index >= 0 && index < kCount ? &kPresets[index] : nullptr; }

const ModelPreset* find_preset(const std::string& name) {
  for (const ModelPreset& p : kPresets)
    if (name == p.name) return &p;
  return nullptr;
}

std::string preset_names(const char* separator) {
  std::string out;
  for (const ModelPreset& p : kPresets) out += (out.empty() ? "" : separator) + std::string(p.name);
  return out;
}

}  // namespace megamoe
