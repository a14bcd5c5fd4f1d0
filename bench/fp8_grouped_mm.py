"""PyTorch's own FP8 MoE path, as a baseline for megamoe's `fp8` (issue 12):
the TorchTitan pipeline of compare_torch.py (sort by expert, grouped GEMMs,
scatter-add combine) with every grouped GEMM in e4m3 through
torch._scaled_grouped_mm, forward and backward, quantised dynamically with
torch ops (no Triton, no torchao):

  forward  out = a @ w[e]^T     a rowwise (one scale per row over K),
                                w rowwise per (expert, output column)
  dgrad    da = g @ w[e]        g rowwise, w^T rowwise per (expert, column)
  wgrad    dw[e] = g_e^T a_e    K = the expert's rows: g and a scaled per
                                (expert, column) over the expert's rows

Scales are fp32, amax / 448 (e4m3's largest finite value), quantised values
saturated. This is coarser than megamoe's recipe (1 x 128 / 128 x 128
blocks), so it does less work per element; torch._scaled_grouped_mm needs
the K groups of the weight gradient on 16-row boundaries (route_plan's
align 16). On the CPU (no FP8 kernel) a per-group loop over the dequantised
operands stands in, for plumbing tests."""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TINY = 1e-12  # amax floor: an all-zero row or group gets a finite scale


def _quantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> e4m3 [R, C] and one fp32 scale per row [R] (dequantised = q * scale)."""
    s = t.abs().amax(dim=-1).float().clamp_min(TINY) / E4M3_MAX
    return _quantize(t, s[:, None]), s


def grouped_columnwise(t: torch.Tensor, group: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] with each row's group (groups = none: rows past the last group) -> e4m3 [R, C] and
    one scale per (group, column) [groups, C] over the group's rows."""
    amax = torch.zeros(groups + 1, t.shape[1], dtype=torch.float32, device=t.device)
    amax.scatter_reduce_(0, group[:, None].expand(-1, t.shape[1]), t.abs().float(), "amax")
    s = amax.clamp_min(TINY) / E4M3_MAX
    return _quantize(t, s[group]), s[:groups]


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=torch.bfloat16, use_fast_accum=False):
    """torch._scaled_grouped_mm's math on the dequantised operands, group by group (CPU plumbing).
    a [M, K] with b [G, K, N]: M groups (rows past offs[-1] left zero); a [M, K] with b [K, N]: K groups
    (out [G, M, N]; scale_a [G * M], scale_b [G * N])."""
    af = a.float()
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[-1], dtype=out_dtype, device=a.device)
        start = 0
        for g, end in enumerate(offs.tolist()):
            rows = slice(start, end)
            out[rows] = ((af[rows] * scale_a[rows, None]) @ (b[g].float() * scale_b[g][None, :])).to(out_dtype)
            start = end
        return out
    M, N, G = a.shape[0], b.shape[1], offs.numel()
    out = torch.zeros(G, M, N, dtype=out_dtype, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        ks = slice(start, end)
        lhs = af[:, ks] * scale_a[g * M:(g + 1) * M, None]
        rhs = b[ks].float() * scale_b[g * N:(g + 1) * N][None, :]
        out[g] = (lhs @ rhs).to(out_dtype)
        start = end
    return out


def _sgmm(device: torch.device):
    return torch._scaled_grouped_mm if device.type == "cuda" else emulated_scaled_grouped_mm


def _groups(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's group from the groups' end rows (rows past offs[-1]: len(offs))."""
    return torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)


class Fp8GroupedMM(torch.autograd.Function):
    """out[rows of group e] = a[rows] @ w[e]^T in e4m3 (a [M, K] bf16, w [E, N, K] bf16, offs [E] int32 ends)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        E, N, K = w.shape
        if K % 16 or N % 16 or E >= 1024:
            raise ValueError(f"torch._scaled_grouped_mm needs K and N multiples of 16 and < 1024 groups: {K}, {N}, {E}")
        aq, sa = rowwise(a)
        wq, sw = rowwise(w.reshape(E * N, K))
        ctx.save_for_backward(a, w, offs)
        return _sgmm(a.device)(aq, wq.view(E, N, K).transpose(-2, -1), sa, sw.view(E, N), offs,
                               out_dtype=torch.bfloat16, use_fast_accum=True)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a, w, offs = ctx.saved_tensors
        E, N, K = w.shape
        sgmm = _sgmm(a.device)
        g = g.contiguous()
        # dgrad: g @ w[e], B = w[e] as [N, K] column-major: the transposed copy quantised per (e, k).
        gq, sg = rowwise(g)
        wt = w.transpose(-2, -1).contiguous()  # [E, K, N]
        wtq, swt = rowwise(wt.reshape(E * K, N))
        da = sgmm(gq, wtq.view(E, K, N).transpose(-2, -1), sg, swt.view(E, K), offs, out_dtype=torch.bfloat16,
                  use_fast_accum=True)
        # wgrad: dw[e] = g_e^T a_e, both scaled per (expert, column) over the expert's rows. Its
        # operands' inner size is the row count, which must be a multiple of 16: rows of zeros past
        # offs[-1] (never read) make it one.
        pad = -a.shape[0] % 16
        if pad:
            g = torch.nn.functional.pad(g, (0, 0, 0, pad))
            a = torch.nn.functional.pad(a, (0, 0, 0, pad))
        group = _groups(offs, a.shape[0])
        gcq, sgc = grouped_columnwise(g, group, E)
        acq, sac = grouped_columnwise(a, group, E)
        dw = sgmm(gcq.t().contiguous(), acq.t().contiguous().t(), sgc.reshape(-1), sac.reshape(-1), offs,
                  out_dtype=torch.bfloat16, use_fast_accum=True)  # [E, N, K]
        return da, dw, None


def fp8_gmm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Drop-in for torch._grouped_mm(a, w.transpose(-2, -1), offs=offs) in compare_torch's pipeline."""
    return Fp8GroupedMM.apply(a, b_t.transpose(-2, -1), offs)
