// Status: the error type of every megamoe entry point. Messages name the
// offending argument ("topk_idx[3,1] = 130 is out of range [-1, 128)").
#pragma once

#include <string>
#include <utility>

namespace megamoe {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // a caller-provided value is wrong (shape, dtype, range)
  kCapacity,         // more tokens/rows than the workspace was sized for
  kUnimplemented,    // a valid request this build or device cannot serve
  kUnavailable,      // a resource is missing (no GPU, peer never arrived)
  kInternal,         // a bug or a failed CUDA call
  kTimeout,          // a device spin-wait gave up (a peer or pipeline stage never arrived)
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: x: expected dtype bf16, got f32"
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string msg) {
  return Status(StatusCode::kInvalidArgument, std::move(msg));
}
inline Status capacity_error(std::string msg) {
  return Status(StatusCode::kCapacity, std::move(msg));
}
inline Status unimplemented(std::string msg) {
  return Status(StatusCode::kUnimplemented, std::move(msg));
}
inline Status unavailable(std::string msg) {
  return Status(StatusCode::kUnavailable, std::move(msg));
}
inline Status timeout_error(std::string msg) {
  return Status(StatusCode::kTimeout, std::move(msg));
}
inline Status internal_error(std::string msg) {
  return Status(StatusCode::kInternal, std::move(msg));
}

}  // namespace megamoe

#define MEGAMOE_RETURN_IF_ERROR(expr)              \
  do {                                             \
    ::megamoe::Status megamoe_status_ = (expr);    \
    if (!megamoe_status_.ok()) return megamoe_status_; \
  } while (0)
