// A self-check of peer memory, whatever provided it (the one-process group of
// peer_memory.h, PyTorch symmetric memory through the C ABI): every rank
// writes a payload that encodes (source rank, destination rank, index) into
// its own region of every rank's buffer through the peer table; once every
// rank's writes are complete and visible (the caller's barrier), each rank
// counts the words of its own buffer that do not hold what their writer put
// there. A wrong peer table, a buffer smaller than it claims or a mapping
// that does not reach the peer shows up as a nonzero count (or a fault).
//
// Layout of each rank's buffer during the check: `world` regions of
// words_per_region(view) u32 words; region s is written by rank s with
// peer_payload(s, owner, i). Whatever the buffer held before is overwritten.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/comm/peer_memory.h"
#include "megamoe/status.h"

namespace megamoe::cuda {

__host__ __device__ inline uint32_t peer_payload(int src, int dst, uint32_t i) {
  return (static_cast<uint32_t>(src) << 28) | (static_cast<uint32_t>(dst) << 24) | (i & 0xFFFFFFu);
}
inline uint64_t words_per_region(const PeerView& v) { return v.bytes / 4 / static_cast<uint64_t>(v.world); }

// Checks the view's fields (rank in [0, world), 1 <= world <= 8, pointers set,
// at least one word per region).
Status validate_peer_view(const PeerView& v);

// Phase 1, on every rank: write this rank's region of every rank's buffer (async on `stream`).
Status peer_check_write(const PeerView& v, cudaStream_t stream);

// Phase 2, after every rank's phase 1 has completed: count the wrong words of
// this rank's buffer into *wrong_device (an int64 in device memory, set, not
// added to). Async on `stream`.
Status peer_check_count(const PeerView& v, int64_t* wrong_device, cudaStream_t stream);

}  // namespace megamoe::cuda
