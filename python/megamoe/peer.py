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

from . import _lib

MAX_WORLD = 8  # the library's expert-parallel limit (one node)


@dataclass
class SymmetricBuffer:
    """One rank's symmetric buffer of `nbytes` bytes and its peer table."""
    tensor: torch.Tensor  # uint8 [nbytes], this rank's buffer
    handle: object        # torch's _SymmetricMemory (keeps the mapping alive)
    rank: int
    world: int
    nbytes: int

    @property
    def peers_device_ptr(self) -> int:
        """Device address of the table [world] of buffer pointers (as this rank's GPU sees them)."""
        return int(self.handle.buffer_ptrs_dev)


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
    return SymmetricBuffer(tensor, handle, int(handle.rank), int(handle.world_size), nbytes)


def _peer_check(buf: SymmetricBuffer, phase: int, wrong=None) -> None:
    stream = torch.cuda.current_stream()
    _lib.check(_lib.lib().megamoe_peer_check(phase, buf.rank, buf.world, buf.tensor.data_ptr(), buf.peers_device_ptr,
                                             buf.nbytes, stream.cuda_stream, wrong))


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
    torch.cuda.current_stream().synchronize()  # this rank's writes have completed ...
    dist.barrier(group)                  # ... and so have every other rank's
    wrong = count_wrong_words(buf)
    dist.barrier(group)                  # nobody writes again before everyone has counted
    if wrong != 0:
        raise _lib.MegaMoEError(f"megamoe.peer: rank {buf.rank} of {buf.world}: {wrong} words of its "
                                f"{buf.nbytes}-byte symmetric buffer do not hold what their writer put there")
    return buf
