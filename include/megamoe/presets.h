// The model shapes megamoe is built and measured for: the one definition that
// the CLI, megamoe-bench and (through megamoe_preset in the C ABI) the Python
// trainer and benchmarks all read.
#pragma once

#include <cstdint>
#include <string>

namespace megamoe {

struct ModelPreset {
  const char* name;
  // The MoE layer.
  int64_t hidden;
  int64_t intermediate;  // per expert
  int num_experts;
  int top_k;
  // The rest of the decoder layer (the trainer builds a Qwen3-MoE model from these).
  int attention_heads;
  int kv_heads;
  int head_dim;
};

// Number of presets; preset(i) for i in [0, count) (nullptr outside).
int preset_count();
const ModelPreset* preset(int index);
// The preset named `name`, or nullptr.
const ModelPreset* find_preset(const std::string& name);
// "tiny|qwen3-30b-a3b|..." for usage lines and error messages.
std::string preset_names(const char* separator = "|");

}  // namespace megamoe
