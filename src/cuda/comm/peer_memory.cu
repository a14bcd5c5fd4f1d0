#include "cuda/comm/peer_memory.h"

#include <cuda_runtime.h>

#include <string>

#include "cuda/common/cuda_status.h"

namespace megamoe::cuda {
namespace {

class OneProcessGroup final : public PeerGroup {
 public:
  ~OneProcessGroup() override { release(); }

  Status init(const std::vector<int>& devices, size_t bytes) {
    devices_ = devices;
    bytes_ = bytes;
    int count = 0;
    MEGAMOE_RETURN_IF_ERROR(cuda_status("peer memory: cudaGetDeviceCount", cudaGetDeviceCount(&count)));
    for (int d : devices)
      if (d < 0 || d >= count)
        return invalid_argument("peer memory: device " + std::to_string(d) + " does not exist (" +
                                std::to_string(count) + " visible)");
    MEGAMOE_RETURN_IF_ERROR(enable_peer_access());
    const int world = static_cast<int>(devices.size());
    buffers_.assign(devices.size(), nullptr);
    tables_.assign(devices.size(), nullptr);
    for (int r = 0; r < world; ++r) {
      MEGAMOE_RETURN_IF_ERROR(cuda_status("peer memory: cudaSetDevice", cudaSetDevice(devices[r])));
      MEGAMOE_RETURN_IF_ERROR(cuda_status("peer memory: allocate rank " + std::to_string(r) + "'s buffer",
                                          cudaMalloc(&buffers_[r], bytes)));
      MEGAMOE_RETURN_IF_ERROR(cuda_status("peer memory: zero rank " + std::to_string(r) + "'s buffer",
                                          cudaMemset(buffers_[r], 0, bytes)));
    }
    // Every rank's table holds every buffer's address: with unified addressing
    // and peer access enabled, a device pointer is valid on its peers as is.
    for (int r = 0; r < world; ++r) {
      MEGAMOE_RETURN_IF_ERROR(cuda_status("peer memory: cudaSetDevice", cudaSetDevice(devices[r])));
      void* table = nullptr;
      MEGAMOE_RETURN_IF_ERROR(cuda_status("peer memory: allocate rank " + std::to_string(r) + "'s peer table",
                                          cudaMalloc(&table, world * sizeof(void*))));
      tables_[r] = static_cast<void**>(table);
      MEGAMOE_RETURN_IF_ERROR(cuda_status("peer memory: fill rank " + std::to_string(r) + "'s peer table",
                                          cudaMemcpy(table, buffers_.data(), world * sizeof(void*),
                                                     cudaMemcpyHostToDevice)));
    }
    return Status::Ok();
  }

  int world() const override { return static_cast<int>(devices_.size()); }
  int device(int rank) const override { return devices_[static_cast<size_t>(rank)]; }
  PeerView view(int rank) const override {
    PeerView v;
    v.rank = rank;
    v.world = world();
    v.local = buffers_[static_cast<size_t>(rank)];
    v.peers = tables_[static_cast<size_t>(rank)];
    v.bytes = bytes_;
    return v;
  }

 private:
  Status enable_peer_access() {
    for (size_t a = 0; a < devices_.size(); ++a)
      for (size_t b = 0; b < devices_.size(); ++b) {
        const int da = devices_[a], db = devices_[b];
        if (da == db) continue;
        int can = 0;
        MEGAMOE_RETURN_IF_ERROR(
            cuda_status("peer memory: cudaDeviceCanAccessPeer", cudaDeviceCanAccessPeer(&can, da, db)));
        if (!can)
          return unavailable("peer memory: device " + std::to_string(da) + " cannot access device " +
                             std::to_string(db) + " (no peer-to-peer path)");
        MEGAMOE_RETURN_IF_ERROR(cuda_status("peer memory: cudaSetDevice", cudaSetDevice(da)));
        const cudaError_t err = cudaDeviceEnablePeerAccess(db, 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();  // not an error here; clear it
        } else {
          MEGAMOE_RETURN_IF_ERROR(cuda_status("peer memory: enable access from device " + std::to_string(da) +
                                                  " to " + std::to_string(db),
                                              err));
        }
      }
    return Status::Ok();
  }

  void release() {
    for (size_t r = 0; r < devices_.size(); ++r) {
      if (r < tables_.size() && tables_[r] != nullptr) cudaFree(tables_[r]);
      if (r < buffers_.size() && buffers_[r] != nullptr) cudaFree(buffers_[r]);
    }
    tables_.clear();
    buffers_.clear();
  }

  std::vector<int> devices_;
  size_t bytes_ = 0;
  std::vector<void*> buffers_;
  std::vector<void**> tables_;
};

}  // namespace

Status make_one_process_group(const std::vector<int>& devices, size_t bytes, std::unique_ptr<PeerGroup>* out) {
  if (out == nullptr) return invalid_argument("peer memory: out is null");
  if (devices.empty() || devices.size() > 8)
    return invalid_argument("peer memory: world = " + std::to_string(devices.size()) + ": expected 1 to 8 ranks");
  if (bytes == 0 || bytes % 256 != 0)
    return invalid_argument("peer memory: bytes = " + std::to_string(bytes) + ": expected a positive multiple of 256");
  int current = 0;
  cudaGetDevice(&current);
  auto group = std::make_unique<OneProcessGroup>();
  const Status st = group->init(devices, bytes);
  cudaSetDevice(current);
  if (!st.ok()) return st;  // the group's destructor frees what was allocated
  *out = std::move(group);
  return Status::Ok();
}

}  // namespace megamoe::cuda
