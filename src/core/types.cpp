#include "megamoe/types.h"


namespace megamoe {

const char* to_string(DType v) {
  switch (v) {
    case DType::kBF16: return "bf16";
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kI32: return "i32";
    case DType::kFP8E4M3: return "fp8_e4m3";
  }
  return "?";
}
const char* to_string(DeviceType v) { return v == DeviceType::kCPU ? "cpu" : "cuda"; }
const char* to_string(Precision v) {
  switch (v) {
    case Precision::kBF16: return "bf16";
    case Precision::kFP8: return "fp8";
    case Precision::kFP8Bwd: return "fp8_bwd";
    case Precision::kMXFP8: return "mxfp8";
  }
  return "?";
}
const char* to_string(SavePolicy v) { return v == SavePolicy::kKeep ? "keep" : "recompute"; }
const char* to_string(Backend v) {
  switch (v) {
    case Backend::kCPU: return "cpu";
    case Backend::kCUDA: return "cuda";
    case Backend::kAuto: return "auto";
  }
  return "?";
}
const char* to_string(ScaleMode v) { return v == ScaleMode::kFloat32 ? "fp32" : "pow2"; }

namespace {
template <typename E, size_t N>
Status parse_enum(const char* what, const std::string& s, const E (&values)[N], E* out) {
  std::string options;
  for (E v : values) {
    if (s == to_string(v)) {
      *out = v;
      return Status::Ok();
    }
    options += options.empty() ? "" : " | ";
    options += to_string(v);
  }
  return invalid_argument(std::string(what) + ": unknown value '" + s + "' (expected " + options + ")");
}
}  // namespace

Status parse_precision(const std::string& s, Precision* out) {
  static const Precision kAll[] = {Precision::kBF16, Precision::kFP8, Precision::kFP8Bwd, Precision::kMXFP8};
  return parse_enum("precision", s, kAll, out);
}
Status parse_save_policy(const std::string& s, SavePolicy* out) {
  static const SavePolicy kAll[] = {SavePolicy::kKeep, SavePolicy::kRecompute};
  return parse_enum("save policy", s, kAll, out);
}
Status parse_backend(const std::string& s, Backend* out) {
  static const Backend kAll[] = {Backend::kCPU, Backend::kCUDA, Backend::kAuto};
  return parse_enum("backend", s, kAll, out);
}
Status parse_scale_mode(const std::string& s, ScaleMode* out) {
  static const ScaleMode kAll[] = {ScaleMode::kFloat32, ScaleMode::kPowerOfTwo};
  return parse_enum("scale mode", s, kAll, out);
}

int dtype_size(DType v) {
  switch (v) {
    case DType::kBF16: return 2;
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kI32: return 4;
    case DType::kFP8E4M3: return 1;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank && i < kMaxRank; ++i) n *= shape[i];
  return n;
}

// std::to_string rather than iostreams: the library may share a process with
// other C++ runtimes (a PyTorch interpreter), and locale/iostream state is the
// usual casualty of such mixes.
std::string TensorView::shape_string() const {
  if (rank < 0 || rank > kMaxRank) return "[rank > " + std::to_string(kMaxRank) + "]";
  std::string out = "[";
  for (int i = 0; i < rank; ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape, DeviceType device,
                     int device_index) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.device_index = device_index;
  for (int64_t d : shape) {
    if (v.rank < TensorView::kMaxRank) v.shape[v.rank] = d;
    ++v.rank;
  }
  if (v.rank > TensorView::kMaxRank) v.rank = -1;  // invalid: every shape check rejects it
  return v;
}

}  // namespace megamoe
