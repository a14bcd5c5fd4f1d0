"""Peer memory for expert parallelism through PyTorch symmetric memory.

The library's kernels see peer memory as a PeerView (src/cuda/comm/peer_memory.h):
this rank's buffer, a device array of every rank's buffer as this rank's GPU
sees it, rank and world. `SymmetricBuffer` is the PyTorch provider of it:
`torch.distributed._symmetric_memory.empty` allocates the same size on every
rank of the process group and `rendezvous` maps the peers' buffers, whose
handle already holds the device table of peer pointers.

NVLink multicast stays off: TORCH_SYMM_MEM_DISABLE_MULTICAST is set to 1 here
unless the caller set it (multicast objects are never created by megamoe).

`check_peer_memory(group)` proves a group's mapping before training relies
on it: every rank writes a payload that encodes (source rank, destination
rank, index) into every rank's buffer through the peer table, and each rank
counts the words of its own buffer that do not hold what their writer put
there. Collective: every rank of the group calls it.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from . import _abi

MAX_WORLD = 8  # the library's expert-parallel limit (one node)


@dataclass
class SymmetricBuffer:
    """One rank's symmetric buffer of `nbytes` bytes and its peer table."""
    tensor: torch.Tensor  # uint8 [nbytes], this rank's buffer
    handle: object        # torch's _SymmetricMemory (keeps the mapping alive)
    rank: int
    world: int
    nbytes: int
    peers: torch.Tensor   # int64 [world] on this rank's GPU: every rank's buffer, as this GPU sees it

    @property
    def peers_device_ptr(self) -> int:
        """Device address of the table [world] of buffer pointers."""
        return self.peers.data_ptr()


def symmetric_buffer(nbytes: int, group) -> SymmetricBuffer:
    """Allocates `nbytes` on every rank of `group` (collective) and maps the peers' buffers."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if not dist.is_initialized():
        raise RuntimeError("megamoe.peer: torch.distributed is not initialised (init_process_group first)")
    world = dist.get_world_size(group)
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"megamoe.peer: the group has {world} ranks; expert parallelism runs 1 to {MAX_WORLD}")
    if nbytes < 4 * world:
        raise ValueError(f"megamoe.peer: nbytes = {nbytes} leaves no 4-byte word for each of {world} ranks")
    device = torch.device("cuda", torch.cuda.current_device())
    tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(tensor, group)
    rank, world = int(handle.rank), int(handle.world_size)
    # The handle's pointers are the bases of each rank's allocation block, and
    # torch may place the tensor inside a pooled block: add the tensor's offset
    # (the same on every rank, the allocation being symmetric).
    bases = [int(p) for p in handle.buffer_ptrs]
    offset = tensor.data_ptr() - bases[rank]
    if offset < 0 or offset + nbytes > int(handle.buffer_size):
        raise RuntimeError(f"megamoe.peer: the tensor lies outside its symmetric block (offset {offset}, "
                           f"{nbytes} bytes, block of {int(handle.buffer_size)})")
    peers = torch.tensor([b + offset for b in bases], dtype=torch.int64, device=device)
    return SymmetricBuffer(tensor, handle, rank, world, nbytes, peers)


def _peer_check(buf: SymmetricBuffer, phase: int, wrong=None) -> None:
    with torch.cuda.device(buf.tensor.device):
        stream = torch.cuda.current_stream()
        _abi.check(_abi.lib().megamoe_peer_check(phase, buf.rank, buf.world, buf.tensor.data_ptr(),
                                                 buf.peers_device_ptr, buf.nbytes, stream.cuda_stream, wrong))


def write_payload(buf: SymmetricBuffer) -> None:
    """This rank's payload into its region of every rank's buffer (async on the current stream)."""
    _peer_check(buf, 0)


def count_wrong_words(buf: SymmetricBuffer) -> int:
    """Words of this rank's buffer that do not hold what their writer put there (synchronises the
    current stream). Call it once every rank's write_payload has completed."""
    wrong = ctypes.c_int64(-1)
    _peer_check(buf, 1, ctypes.byref(wrong))
    return int(wrong.value)


def check_peer_memory(group, nbytes: int = 1 << 20) -> SymmetricBuffer:
    """Collective self-check of the group's peer memory; returns the buffer it used.

    Raises MegaMoEError naming this rank and the count of wrong words when the
    mapping does not deliver every rank's writes to every rank.
    """
    import torch.distributed as dist

    buf = symmetric_buffer(nbytes, group)
    dist.barrier(group)                  # every rank's buffer exists
    write_payload(buf)
    torch.cuda.current_stream(buf.tensor.device).synchronize()  # this rank's writes have completed ...
    dist.barrier(group)                  # ... and so have every other rank's
    wrong = count_wrong_words(buf)
    # Every rank learns every count, so that all raise together (one rank
    # raising alone would leave the others hanging at their next collective).
    counts = torch.tensor([wrong], dtype=torch.int64, device=buf.tensor.device)
    gathered = [torch.zeros_like(counts) for _ in range(buf.world)]
    dist.all_gather(gathered, counts, group=group)
    bad = {r: int(c.item()) for r, c in enumerate(gathered) if int(c.item()) != 0}
    if bad:
        raise _abi.MegaMoEError("megamoe.peer: words that do not hold what their writer put there, by rank of "
                                f"{buf.world} ({buf.nbytes}-byte symmetric buffers): {bad}")
    return buf
