// Peer memory for expert parallelism: one symmetric buffer per rank (same
// size and layout on every rank), mapped into every rank's address space.
// Kernels see plain pointers only (PeerView); who allocated the memory and how
// it is mapped is a provider's business:
//   - one process driving several ranks (make_one_process_group below: C++
//     tests and benchmarks; several ranks may share one GPU),
//   - PyTorch symmetric memory (torch.distributed._symmetric_memory, rendezvous
//     on the EP process group), whose handle already holds a device table of
//     peer pointers: the Python layer fills a PeerView from it.
// NVLink multicast is never used (no cuMulticastCreate).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "megamoe/status.h"

namespace megamoe::cuda {

// One rank's view of the group's symmetric buffers (trivially copyable: passed to kernels by value).
struct PeerView {
  int rank = 0;
  int world = 1;
  void* local = nullptr;         // this rank's buffer (== peers[rank] as seen from this rank)
  void* const* peers = nullptr;  // device array [world]: every rank's buffer, mapped for this rank's device
  size_t bytes = 0;              // size of each rank's buffer
};

class PeerGroup {
 public:
  virtual ~PeerGroup() = default;
  virtual int world() const = 0;
  // The device that rank `rank` runs on.
  virtual int device(int rank) const = 0;
  virtual PeerView view(int rank) const = 0;
};

// One process, rank r on devices[r] (repeats allowed: several ranks on one GPU).
// Allocates `bytes` (zeroed) per rank and enables peer access between distinct
// devices; fails with a Status naming the pair when two devices cannot reach
// each other. Nothing is left allocated on failure.
Status make_one_process_group(const std::vector<int>& devices, size_t bytes, std::unique_ptr<PeerGroup>* out);

}  // namespace megamoe::cuda
