"""A plain PyTorch MoE layer (the math of docs/design.md), for checking the op."""
import torch
import torch.nn.functional as F


def moe_reference(x, topk_idx, topk_weights, w13, w2):
    y = torch.zeros_like(x)
    I = w2.shape[-1]
    for t in range(x.shape[0]):
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[t, j])
            if e < 0:
                continue
            z = w13[e] @ x[t]
            a = F.silu(z[:I]) * z[I:]
            y[t] = y[t] + topk_weights[t, j] * (w2[e] @ a)
    return y


def random_inputs(T=7, H=128, I=128, E=4, k=2, dtype=torch.float64, seed=0, drop=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    if drop:
        idx[min(2, T - 1), k - 1] = -1
    w = torch.rand(T, k, generator=g, dtype=torch.float64) + 0.1
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I ** 0.5
    cast = lambda t: t.to(device=device, dtype=dtype).requires_grad_()
    return cast(x), idx.to(device), cast(w), cast(w13), cast(w2)
