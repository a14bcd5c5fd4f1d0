"""CPU checks of the expert-parallel benchmarks' own logic (bench/ep_vdev_probe.py): what they
send must be what the pipeline they model sends."""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))

from ep_vdev_probe import _route_rows  # noqa: E402


def test_route_rows_come_grouped_by_destination_rank_in_route_order():
    x = torch.arange(5 * 4, dtype=torch.float32).reshape(5, 4)  # row t holds 4t .. 4t + 3
    idx = torch.tensor([[0, 3], [2, -1], [1, 2], [3, 0], [-1, -1]])  # 4 experts, 2 a rank; -1: no route
    rows, counts = _route_rows(x, idx, L=2, world=2)
    assert counts.tolist() == [3, 4]
    tokens = (rows[:, 0] / 4).long().tolist()
    assert tokens == [0, 2, 3, 0, 1, 2, 3]  # rank 0: (0, e0) (2, e1) (3, e0); rank 1: (0, e3) (1, e2) (2, e2) (3, e3)


def test_route_rows_send_nothing_for_dropped_routes():
    x = torch.ones(3, 8)
    rows, counts = _route_rows(x, torch.full((3, 2), -1), L=4, world=2)
    assert rows.shape == (0, 8) and counts.tolist() == [0, 0]
