// Shared bits of the GPU tests: skipping without a device, running the layer.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

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
  return o;
}

}  // namespace megamoe::testing
