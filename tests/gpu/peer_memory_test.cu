// Peer memory (cuda/comm/peer_memory.h) under its self-check
// (cuda/comm/peer_check.h): every rank writes a payload that encodes (source
// rank, destination rank, index) into every rank's buffer through its peer
// table; each region must hold exactly what its writer put there. Several ranks on one GPU (P = 4 and 8) run on any GPU; the 2-GPU
// case (MultiGpu.*) needs two GPUs with a peer-to-peer path.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/comm/peer_check.h"
#include "cuda/comm/peer_memory.h"
#include "gpu_test_util.h"

namespace megamoe::testing {
namespace {

// The library's self-check (cuda/comm/peer_check.h) on a one-process group:
// every rank writes its payload into every rank's buffer, then each rank's
// buffer must count 0 wrong words. Then one word of the last rank's buffer is
// spoiled: its count must be exactly 1 (the check can fail).
void exchange_and_check(const std::vector<int>& devices) {
  const int world = static_cast<int>(devices.size());
  const size_t bytes = 256 * 1024;
  std::unique_ptr<cuda::PeerGroup> group;
  const Status st = cuda::make_one_process_group(devices, bytes, &group);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_EQ(group->world(), world);
  for (int r = 0; r < world; ++r) {
    const cuda::PeerView v = group->view(r);
    ASSERT_EQ(v.rank, r);
    ASSERT_EQ(v.bytes, bytes);
    ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
    MEGAMOE_ASSERT_OK(cuda::peer_check_write(v, nullptr));
  }
  for (int d : devices) {
    ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  auto wrong_words = [&](int r) -> int64_t {
    EXPECT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
    int64_t* count = nullptr;
    int64_t host = -1;
    EXPECT_EQ(cudaMalloc(&count, sizeof(int64_t)), cudaSuccess);
    const Status c = cuda::peer_check_count(group->view(r), count, nullptr);
    EXPECT_TRUE(c.ok()) << c.to_string();
    EXPECT_EQ(cudaMemcpy(&host, count, sizeof(int64_t), cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(count);
    return host;
  };
  for (int r = 0; r < world; ++r) EXPECT_EQ(wrong_words(r), 0) << "rank " << r << "'s buffer";
  const cuda::PeerView last = group->view(world - 1);
  ASSERT_EQ(cudaSetDevice(group->device(world - 1)), cudaSuccess);
  ASSERT_EQ(cudaMemset(static_cast<char*>(last.local) + 4 * 7, 0xAB, 4), cudaSuccess);
  EXPECT_EQ(wrong_words(world - 1), 1) << "one spoiled word";
  cudaSetDevice(0);
}

TEST(PeerMemory, FourRanksOnOneGpuExchangePayloads) {
  MEGAMOE_REQUIRE_GPU();
  exchange_and_check({0, 0, 0, 0});
}

TEST(PeerMemory, EightRanksOnOneGpuExchangePayloads) {
  MEGAMOE_REQUIRE_GPU();
  exchange_and_check({0, 0, 0, 0, 0, 0, 0, 0});
}

// No GPU needed: a view is checked before anything is launched.
TEST(PeerMemory, BadViewsAreErrorsNamingTheField) {
  void* fake[2] = {reinterpret_cast<void*>(0x1000), reinterpret_cast<void*>(0x2000)};
  auto view = [&](int rank, int world, size_t bytes) {
    cuda::PeerView v;
    v.rank = rank, v.world = world, v.local = fake[0], v.peers = fake, v.bytes = bytes;
    return v;
  };
  auto message = [](const Status& st) { return st.ok() ? std::string("ok") : st.message(); };
  EXPECT_NE(message(cuda::validate_peer_view(view(0, 0, 1024))).find("world = 0 is not in [1, 8]"), std::string::npos);
  EXPECT_NE(message(cuda::validate_peer_view(view(0, 9, 1024))).find("world = 9"), std::string::npos);
  EXPECT_NE(message(cuda::validate_peer_view(view(2, 2, 1024))).find("rank = 2 is not in [0, world = 2)"),
            std::string::npos);
  EXPECT_NE(message(cuda::validate_peer_view(view(0, 2, 4))).find("leave no 4-byte word for each of 2 ranks"),
            std::string::npos);
  cuda::PeerView v = view(0, 2, 1024);
  v.local = nullptr;
  EXPECT_NE(message(cuda::validate_peer_view(v)).find("null"), std::string::npos);
  EXPECT_TRUE(cuda::validate_peer_view(view(1, 2, 1024)).ok());
  EXPECT_NE(message(cuda::peer_check_count(view(1, 2, 1024), nullptr, nullptr)).find("count's pointer is null"),
            std::string::npos);
}

TEST(PeerMemory, BadArgumentsAreErrors) {
  MEGAMOE_REQUIRE_GPU();
  std::unique_ptr<cuda::PeerGroup> g;
  EXPECT_EQ(cuda::make_one_process_group({}, 1024, &g).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::make_one_process_group(std::vector<int>(9, 0), 1024, &g).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::make_one_process_group({0}, 0, &g).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::make_one_process_group({0}, 100, &g).code(), StatusCode::kInvalidArgument);
  const Status st = cuda::make_one_process_group({0, 99}, 1024, &g);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("device 99 does not exist"), std::string::npos) << st.message();
  EXPECT_EQ(g, nullptr);
}

// Two GPUs (ranks on devices 0 and 1, then two ranks on each): needs the 2-GPU machine.
TEST(MultiGpu, PeerMemoryOverNvlink) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) GTEST_SKIP() << "needs 2 GPUs, " << n << " visible";
  exchange_and_check({0, 1});
  exchange_and_check({0, 1, 0, 1});
}

}  // namespace
}  // namespace megamoe::testing
