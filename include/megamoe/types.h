// Torch-free, CUDA-free value types of the public API.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "megamoe/status.h"

namespace megamoe {

enum class DType { kBF16, kF32, kF64, kI32, kFP8E4M3 };
enum class DeviceType { kCPU, kCUDA };

// BF16 forward+backward; FP8 = block-scaled e4m3 (DeepSeek-V3 recipe) both
// ways; FP8Bwd = BF16 forward, FP8 backward; MXFP8 = 1x32 blocks with E8M0
// scales (Blackwell tensor cores; emulated by the CPU reference only).
enum class Precision { kBF16, kFP8, kFP8Bwd, kMXFP8 };
// kKeep saves z and the pooled x for the backward; kRecompute keeps only the
// inputs and recomputes GEMM1 in the backward (+1/3 of the forward FLOPs).
enum class SavePolicy { kKeep, kRecompute };
enum class Backend { kCPU, kCUDA, kAuto };
// How FP8 block scales are stored: any fp32 value, or rounded up to a power of two.
enum class ScaleMode { kFloat32, kPowerOfTwo };

const char* to_string(DType v);
const char* to_string(DeviceType v);
const char* to_string(Precision v);
const char* to_string(SavePolicy v);
const char* to_string(Backend v);
const char* to_string(ScaleMode v);
Status parse_precision(const std::string& s, Precision* out);
Status parse_save_policy(const std::string& s, SavePolicy* out);
Status parse_backend(const std::string& s, Backend* out);
Status parse_scale_mode(const std::string& s, ScaleMode* out);
int dtype_size(DType v);

// A dense, row-major tensor that megamoe does not own.
struct TensorView {
  static constexpr int kMaxRank = 4;
  void* data = nullptr;
  DType dtype = DType::kF32;
  DeviceType device = DeviceType::kCPU;
  int device_index = 0;
  int rank = 0;  // -1: more than kMaxRank dims were given (rejected by every check)
  int64_t shape[kMaxRank] = {0, 0, 0, 0};

  int64_t numel() const;
  int64_t size_bytes() const { return numel() * dtype_size(dtype); }
  bool empty() const { return data == nullptr && rank == 0; }
  std::string shape_string() const;  // "[16, 2048]"
};

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     DeviceType device = DeviceType::kCPU, int device_index = 0);

}  // namespace megamoe
