// Shared bits of the GPU tests: skipping without a device, running the layer.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <memory>

#include "megamoe/moe.h"
#include "testing/device_layer.h"

namespace megamoe::testing {

inline bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

// Under compute-sanitizer (or another CUDA injection tool, e.g. a profiler)
// kernels can run 100x or more slower: an engine wait that takes milliseconds
// can take seconds. compute-sanitizer sets NV_SANITIZER_INJECTION_* in the
// target's environment; other tools CUDA_INJECTION64_PATH.
inline bool under_cuda_tool() {
  for (const char* var : {"NV_SANITIZER_INJECTION_PORT_BASE", "CUDA_INJECTION64_PATH"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && *v != '\0') return true;
  }
  return false;
}

// The spin-wait bound (DeviceErrorSink::timeout_ns) for GPU tests that are
// not about timeouts: MEGAMOE_TEST_WAIT_TIMEOUT_MS when set, else 10 s, or
// 10 minutes under a CUDA tool.
inline uint64_t test_wait_timeout_ns() {
  if (const char* ms = std::getenv("MEGAMOE_TEST_WAIT_TIMEOUT_MS"); ms != nullptr && *ms != '\0')
    return std::strtoull(ms, nullptr, 10) * 1'000'000ull;
  return under_cuda_tool() ? 600'000'000'000ull : 10'000'000'000ull;
}

#define MEGAMOE_REQUIRE_GPU() \
  if (!::megamoe::testing::have_gpu()) GTEST_SKIP() << "no CUDA device visible"

#define MEGAMOE_ASSERT_OK(expr)                      \
  do {                                               \
    const ::megamoe::Status s_ = (expr);             \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.to_string(); \
  } while (0)

inline MoeOptions cuda_options(SavePolicy save = SavePolicy::kKeep, cudaStream_t stream = nullptr) {
  MoeOptions o;
  o.backend = Backend::kCUDA;
  o.save_policy = save;
  o.cuda_stream = stream;
  o.device_timeout_ms = static_cast<int64_t>(test_wait_timeout_ns() / 1'000'000ull);  // longer under sanitizers
  return o;
}

}  // namespace megamoe::testing
