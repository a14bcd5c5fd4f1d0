#include "cuda/comm/peer_check.h"

#include <string>

#include "cuda/common/cuda_status.h"

namespace megamoe::cuda {
namespace {

__global__ void write_regions(PeerView v, uint64_t per) {
  for (int dst = 0; dst < v.world; ++dst) {
    auto* region = static_cast<uint32_t*>(v.peers[dst]) + static_cast<uint64_t>(v.rank) * per;
    for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < per; i += gridDim.x * blockDim.x)
      region[i] = peer_payload(v.rank, dst, static_cast<uint32_t>(i));
  }
}

// Integer atomics only: the count is exact whatever the order.
__global__ void count_wrong(PeerView v, uint64_t per, unsigned long long* wrong) {
  const auto* mine = static_cast<const uint32_t*>(v.local);
  unsigned long long n = 0;
  for (int src = 0; src < v.world; ++src)
    for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < per; i += gridDim.x * blockDim.x)
      n += mine[static_cast<uint64_t>(src) * per + i] != peer_payload(src, v.rank, static_cast<uint32_t>(i));
  if (n != 0) atomicAdd(wrong, n);
}

}  // namespace

Status validate_peer_view(const PeerView& v) {
  if (v.world < 1 || v.world > 8)
    return invalid_argument("peer memory: world = " + std::to_string(v.world) + " is not in [1, 8]");
  if (v.rank < 0 || v.rank >= v.world)
    return invalid_argument("peer memory: rank = " + std::to_string(v.rank) + " is not in [0, world = " +
                            std::to_string(v.world) + ")");
  if (v.local == nullptr || v.peers == nullptr) return invalid_argument("peer memory: a buffer pointer is null");
  if (words_per_region(v) == 0)
    return invalid_argument("peer memory: " + std::to_string(v.bytes) + " bytes leave no 4-byte word for each of " +
                            std::to_string(v.world) + " ranks");
  return Status::Ok();
}

Status peer_check_write(const PeerView& v, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(validate_peer_view(v));
  write_regions<<<16, 256, 0, stream>>>(v, words_per_region(v));
  return cuda_status("peer memory check: write", cudaGetLastError());
}

Status peer_check_count(const PeerView& v, int64_t* wrong_device, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(validate_peer_view(v));
  if (wrong_device == nullptr) return invalid_argument("peer memory check: the count's pointer is null");
  MEGAMOE_RETURN_IF_ERROR(
      cuda_status("peer memory check: clear the count", cudaMemsetAsync(wrong_device, 0, sizeof(int64_t), stream)));
  count_wrong<<<16, 256, 0, stream>>>(v, words_per_region(v), reinterpret_cast<unsigned long long*>(wrong_device));
  return cuda_status("peer memory check: count", cudaGetLastError());
}

}  // namespace megamoe::cuda
