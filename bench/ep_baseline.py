"""The TorchTitan-style expert-parallel MoE that megamoe's EP is measured against
(bench/ep_compare.py, bench/ep_train_bench.py): routes sorted by destination
rank, the split sizes exchanged with all_to_all_single and read on the host (as
TorchTitan does: one host sync per call), NCCL all_to_all_single of the route
rows out and of the expert outputs back (autograd through
torch.distributed.nn), the owner's expert compute (`expert_fn`, e.g. the
torch.compile'd grouped_mm pipeline of bench/compare_torch.py), then the
routing weight and TorchTitan's bf16 scatter_add combine at the source.
A baseline for benchmarks, not part of megamoe.
"""
from __future__ import annotations

import functools

import torch


def a2a_forward(x, idx, w, w13, w2, group, expert_fn):
    """y [T, H] for x [T, H], idx [T, k] (global expert ids, -1 = none), w [T, k], this
    rank's experts w13 [L, 2I, H], w2 [L, H, I]; autograd end to end."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn

    T, H = x.shape
    k = idx.shape[1]
    P, L = dist.get_world_size(group), w13.shape[0]
    flat = idx.reshape(-1).long()
    dest = torch.where(flat >= 0, flat // L, P)
    order = torch.argsort(dest, stable=True)
    counts = torch.bincount(dest, minlength=P + 1)[:P]
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    in_splits, out_splits = counts.tolist(), recv_counts.tolist()  # the host sync TorchTitan also has
    n = sum(in_splits)
    routes = order[:n]
    send_rows = x[routes // k]
    send_ids = (flat[routes] % L).to(torch.int32)
    recv_ids = torch.empty(sum(out_splits), dtype=torch.int32, device=x.device)
    dist.all_to_all_single(recv_ids, send_ids, out_splits, in_splits, group=group)
    recv_rows = dnn.all_to_all_single(x.new_empty(sum(out_splits), H), send_rows, out_splits, in_splits, group=group)
    ones = torch.ones(recv_rows.shape[0], 1, dtype=torch.float32, device=x.device)
    out = expert_fn(recv_rows, recv_ids[:, None], ones, w13, w2)
    back = dnn.all_to_all_single(x.new_empty(n, H), out, in_splits, out_splits, group=group)
    scaled = (back.float() * w.reshape(-1)[routes, None].float()).to(x.dtype)
    return x.new_zeros(T, H).scatter_add(0, (routes // k)[:, None].expand(-1, H), scaled)


def sonicmoe_experts(x, idx, w, w13, w2):
    """The owner's expert compute with SonicMoE (its moe_general_routing_inputs, called as
    bench/compare_torch.py's SonicMoeImpl calls it): row i of x [N, H] through expert
    idx[i, 0] of w13 [L, 2I, H] / w2 [L, H, I], scaled by w[i, 0] (the a2a pipeline passes
    ones: it scales at the source). Autograd through SonicMoE's own backward."""
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import moe_general_routing_inputs

    token = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
    expert = idx.reshape(-1).to(torch.int32).contiguous()
    y, _ = moe_general_routing_inputs(x, w.reshape(-1).contiguous(), token, expert, w13.permute(1, 2, 0), None,
                                      w2.permute(1, 2, 0), None, w13.shape[0], torch.cuda.current_stream().cuda_stream,
                                      ActivationType.SWIGLU, False, True)
    return y


@functools.cache
def compiled_grouped_mm():
    """The owner's expert compute of the baseline: bench/compare_torch.py's grouped_mm
    pipeline under torch.compile (dynamic shapes: the received row count varies)."""
    from compare_torch import grouped_mm_forward
    return torch.compile(functools.partial(grouped_mm_forward, gmm=torch._grouped_mm, align=8), dynamic=True)


def use_a2a_experts(model: torch.nn.Module, group) -> list[torch.nn.Parameter]:
    """Shards every Hugging Face experts module of `model` (gate_up_proj [E, 2I, H],
    down_proj [E, H, I]) over `group` as megamoe.use_megamoe_experts does (rank r keeps
    experts [r E/P, (r + 1) E/P)) and makes it run a2a_forward. Returns the sharded
    parameters (leave them out of DDP; divide their gradients by P under a mean loss)."""
    from torch import nn

    P, r = group.size(), group.rank()
    sharded = []
    for module in model.modules():
        gu, dp = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gu, torch.Tensor) and isinstance(dp, torch.Tensor) and gu.dim() == 3):
            continue
        E = gu.shape[0]
        if E % P != 0:
            raise ValueError(f"ep_baseline: {E} experts do not split over {P} ranks")
        local = slice(r * (E // P), (r + 1) * (E // P))
        with torch.no_grad():
            module.gate_up_proj = nn.Parameter(gu[local].clone())
            module.down_proj = nn.Parameter(dp[local].clone())
        sharded += [module.gate_up_proj, module.down_proj]

        def forward(hidden_states, top_k_index, top_k_weights, m=module):
            return a2a_forward(hidden_states, top_k_index, top_k_weights, m.gate_up_proj, m.down_proj, group,
                               compiled_grouped_mm())
        module.forward = forward
    if not sharded:
        raise ValueError("ep_baseline: no experts module with 3D gate_up_proj / down_proj found")
    return sharded
