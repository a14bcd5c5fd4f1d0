"""bench/fp8_grouped_mm.py: PyTorch's FP8 grouped-GEMM pipeline (issue 12's baseline), on the CPU
through its per-group emulation of torch._scaled_grouped_mm: the quantizers' scales, the layouts
of the three GEMMs, and gradients that match the bf16 pipeline within e4m3's error."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fp8_grouped_mm as f8  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_quantizers_bound_every_scaled_value_and_use_the_amax():
    t = torch.randn(6, 32) * torch.logspace(-3, 3, 6)[:, None]
    q, s = f8.rowwise(t)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6,)
    assert torch.allclose(s, t.abs().amax(1) / 448)
    assert rel(q.float() * s[:, None], t) < 4e-2
    group = torch.tensor([0, 0, 1, 1, 1, 2])  # row 5: past the last group
    qc, sc = f8.grouped_columnwise(t, group, 2)
    assert sc.shape == (2, 32)
    assert torch.allclose(sc[1], t[2:5].abs().amax(0) / 448)
    assert rel(qc[:5].float() * sc[group[:5]], t[:5]) < 4e-2


def test_fp8_grouped_mm_matches_bf16_forward_and_backward():
    torch.manual_seed(0)
    E, N, K = 3, 32, 48
    offs = torch.tensor([16, 48, 64], dtype=torch.int32)  # 16-row groups, 8 trailing rows past the last
    a = torch.randn(72, K, requires_grad=True)  # 72: not a multiple of 16 (the weight gradient pads)
    w = (torch.randn(E, N, K) / K ** 0.5).requires_grad_()
    g = torch.randn(72, N)
    out = f8.fp8_gmm(a, w.transpose(-2, -1), offs)
    (out.float() * g).sum().backward()
    ref_a, ref_w = a.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    start, ref = 0, torch.zeros(72, N)
    for e, end in enumerate(offs.tolist()):
        ref[start:end] = ref_a[start:end] @ ref_w[e].t()
        start = end
    (ref * g).sum().backward()
    assert rel(out[:64], ref[:64]) < 8e-2
    assert rel(a.grad[:64], ref_a.grad[:64]) < 8e-2
    assert rel(w.grad, ref_w.grad) < 8e-2
    assert rel(out[:64], ref[:64]) > 1e-4  # it did quantise
