"""Peer memory through PyTorch symmetric memory (megamoe.peer): two processes, one GPU each.

Runs on the 2-GPU machine (scripts/device-test's pytest-cuda step); elsewhere it
skips and says why. CPU-only checks of the module's arguments run everywhere.
"""
import pytest
import torch

from megamoe import peer


def _two_ranks(rank: int, init_file: str) -> None:
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    try:
        buf = peer.check_peer_memory(dist.group.WORLD, nbytes=1 << 20)
        assert (buf.rank, buf.world) == (rank, 2), (buf.rank, buf.world)
        # A second buffer may sit inside the same pooled block (a nonzero offset): checked too.
        second = peer.check_peer_memory(dist.group.WORLD, nbytes=1 << 20)
        assert second.peers_device_ptr != buf.peers_device_ptr
        # The check can fail: rank 1 spoils one word of its own buffer between the writes and the count.
        peer.write_payload(buf)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            buf.tensor[4 * 9] ^= 0xFF
        got = peer.count_wrong_words(buf)
        assert got == (1 if rank == 1 else 0), f"rank {rank}: {got} wrong words"
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (the 2-GPU machine runs it)")
def test_cuda_symmetric_memory_two_ranks_exchange_payloads(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_two_ranks, args=(str(tmp_path / "init"),), nprocs=2, join=True)


def test_symmetric_buffer_needs_an_initialised_group():
    with pytest.raises(RuntimeError, match="init_process_group first"):
        peer.symmetric_buffer(1 << 20, None)
