// Peer memory (cuda/comm/peer_memory.h): every rank writes a payload that
// encodes (source rank, destination rank, index) into every rank's buffer
// through its peer table; each region must hold exactly what its writer put
// there. Several ranks on one GPU (P = 4 and 8) run on any GPU; the 2-GPU
// case (MultiGpu.*) needs two GPUs with a peer-to-peer path.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/comm/peer_memory.h"
#include "gpu_test_util.h"

namespace megamoe::testing {
namespace {

__host__ __device__ uint32_t payload(int src, int dst, uint32_t i) {
  return (static_cast<uint32_t>(src) << 28) | (static_cast<uint32_t>(dst) << 24) | (i & 0xFFFFFFu);
}

// Rank v.rank writes region v.rank of every rank's buffer (regions of `per` words).
__global__ void write_to_peers(cuda::PeerView v, uint32_t per) {
  for (int dst = 0; dst < v.world; ++dst) {
    auto* region = static_cast<uint32_t*>(v.peers[dst]) + static_cast<size_t>(v.rank) * per;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < per; i += gridDim.x * blockDim.x)
      region[i] = payload(v.rank, dst, i);
  }
}

void exchange_and_check(const std::vector<int>& devices) {
  const int world = static_cast<int>(devices.size());
  const size_t bytes = 256 * 1024;
  std::unique_ptr<cuda::PeerGroup> group;
  const Status st = cuda::make_one_process_group(devices, bytes, &group);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_EQ(group->world(), world);
  const uint32_t per = static_cast<uint32_t>(bytes / 4 / static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const cuda::PeerView v = group->view(r);
    ASSERT_EQ(v.rank, r);
    ASSERT_EQ(v.bytes, bytes);
    ASSERT_EQ(cudaSetDevice(group->device(r)), cudaSuccess);
    write_to_peers<<<8, 256>>>(v, per);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  }
  for (int d : devices) {
    ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  std::vector<uint32_t> host(bytes / 4);
  for (int dst = 0; dst < world; ++dst) {
    const cuda::PeerView v = group->view(dst);
    ASSERT_EQ(cudaMemcpy(host.data(), v.local, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    int64_t wrong = 0;
    for (int src = 0; src < world; ++src)
      for (uint32_t i = 0; i < per; ++i) wrong += host[static_cast<size_t>(src) * per + i] != payload(src, dst, i);
    EXPECT_EQ(wrong, 0) << "rank " << dst << "'s buffer";
  }
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
