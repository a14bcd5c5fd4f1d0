"""nn.Modules over the megamoe op, and the Hugging Face Qwen3-MoE drop-in."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .functional import moe


class MegaMoEExperts(nn.Module):
    """Experts with the Hugging Face (transformers v5) Qwen3-MoE layout and names:
    gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]; so
    checkpoints load unchanged. forward(hidden [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H], like Qwen3MoeExperts.

    ep_group (a process group of P ranks): this rank holds experts
    [rank E/P, (rank + 1) E/P) only (parameters [E/P, ...], tagged
    `_megamoe_ep`: leave them out of DDP / FSDP over the same ranks and divide
    their gradients by P under a mean loss; see megamoe.train) and the layer
    runs expert-parallel (megamoe.ep); top_k_index stays global. max_tokens:
    the most tokens any rank brings to one call (default: agreed at the
    first call). fp8_weight_cache (precision fp8 / fp8_bwd): keep the e4m3
    weights between calls, quantised again once per optimizer step (as
    megamoe.moe); False keeps nothing and quantises in every call.
    fp8_scale: the FP8 block scales, "fp32" or "pow2" (as megamoe.moe)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int, *, precision: str = "bf16",
                 save: str = "keep", ep_group=None, max_tokens: int | None = None, fp8_weight_cache: bool = True,
                 fp8_scale: str = "fp32", device=None, dtype=None):
        super().__init__()
        world = ep_group.size() if ep_group is not None else 1
        if num_experts % world != 0:
            raise ValueError(f"megamoe: {num_experts} experts do not split evenly over {world} ranks")
        self.num_experts, self.hidden_dim, self.intermediate_dim, self.top_k = num_experts, hidden, intermediate, top_k
        local = num_experts // world
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * intermediate, hidden, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(local, hidden, intermediate, device=device, dtype=dtype))
        self.precision, self.save = precision, save
        self._megamoe_config = {"precision": precision, "save": save, "ep_group": ep_group, "max_tokens": max_tokens,
                                "fp8_weight_cache": fp8_weight_cache, "fp8_scale": fp8_scale}
        if world > 1:
            self.gate_up_proj._megamoe_ep = self.down_proj._megamoe_ep = True
        nn.init.normal_(self.gate_up_proj, std=hidden ** -0.5)
        nn.init.normal_(self.down_proj, std=intermediate ** -0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return megamoe_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def megamoe_experts_forward(experts: nn.Module, hidden_states, top_k_index, top_k_weights):
    """Experts forward for any module holding gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    (megamoe's MegaMoEExperts or transformers' Qwen3MoeExperts)."""
    cfg = getattr(experts, "_megamoe_config", {})
    return moe(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj,
               precision=cfg.get("precision", "bf16"), save=cfg.get("save", "keep"), group=cfg.get("ep_group"),
               max_tokens=cfg.get("max_tokens"), fp8_weight_cache=cfg.get("fp8_weight_cache", True),
               fp8_scale=cfg.get("fp8_scale", "fp32"))


class MoE(nn.Module):
    """Router + experts with Qwen3-MoE semantics: softmax over experts, top-k,
    optional renormalisation of the k weights."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *, norm_topk_prob: bool = True,
                 precision: str = "bf16", save: str = "keep", ep_group=None, max_tokens: int | None = None,
                 fp8_weight_cache: bool = True, fp8_scale: str = "fp32", device=None, dtype=None):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)  # over all experts
        self.experts = MegaMoEExperts(num_experts, hidden, intermediate, top_k, precision=precision, save=save,
                                      ep_group=ep_group, max_tokens=max_tokens, fp8_weight_cache=fp8_weight_cache,
                                      fp8_scale=fp8_scale, device=device, dtype=dtype)

    def route(self, h: torch.Tensor):
        probs = F.softmax(self.gate(h).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, index

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        weights, index = self.route(h)
        return self.experts(h, index, weights).reshape(shape)


def use_megamoe_experts(model: nn.Module, *, precision: str = "bf16", save: str = "keep", ep_group=None,
                        max_tokens: int | None = None, fp8_weight_cache: bool = True, fp8_scale: str = "fp32") -> int:
    """Makes every Hugging Face MoE experts module of `model` (transformers v5
    layout: gate_up_proj [E, 2I, H], down_proj [E, H, I], e.g. Qwen3MoeExperts)
    run on megamoe. Parameters, their names and layouts are untouched, so
    checkpoints load and save as before. Returns the number of modules switched.

    ep_group (P ranks): each module keeps only this rank's experts
    [rank E/P, (rank + 1) E/P) and runs expert-parallel. Its parameters become
    new [E/P, ...] tensors tagged `_megamoe_ep`: load the full checkpoint
    first, then shard, then build the optimizer and DDP / FSDP (leaving the
    tagged parameters out of them); a state_dict then holds this rank's
    experts under the full names. max_tokens, fp8_weight_cache, fp8_scale: as MegaMoEExperts."""
    world = ep_group.size() if ep_group is not None else 1
    rank = ep_group.rank() if ep_group is not None else 0
    count = 0
    for module in model.modules():
        gu, dp = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gu, torch.Tensor) and isinstance(dp, torch.Tensor) and gu.dim() == 3 and dp.dim() == 3):
            continue
        if isinstance(module, MegaMoEExperts):
            continue
        if getattr(module, "_megamoe_config", {}).get("ep_group") is not None:
            raise ValueError("megamoe: these experts are sharded already (use_megamoe_experts ran twice?)")
        if world > 1:
            E = gu.shape[0]
            if E % world != 0 or dp.shape[0] != E:
                raise ValueError(f"megamoe: {E} experts do not split evenly over {world} ranks")
            local = slice(rank * (E // world), (rank + 1) * (E // world))
            with torch.no_grad():
                module.gate_up_proj = nn.Parameter(gu[local].clone(), requires_grad=gu.requires_grad)
                module.down_proj = nn.Parameter(dp[local].clone(), requires_grad=dp.requires_grad)
            module.gate_up_proj._megamoe_ep = module.down_proj._megamoe_ep = True
        module._megamoe_config = {"precision": precision, "save": save, "ep_group": ep_group if world > 1 else None,
                                  "max_tokens": max_tokens, "fp8_weight_cache": fp8_weight_cache,
                                  "fp8_scale": fp8_scale}
        module.forward = _bound_forward(module)
        count += 1
    if count == 0:
        raise ValueError("megamoe: no MoE experts module with 3D gate_up_proj/down_proj found (transformers >= 5 "
                         "Qwen3-MoE layout expected; the per-expert ModuleList layout of transformers 4 is not supported)")
    return count


def _bound_forward(module):
    def forward(hidden_states, top_k_index, top_k_weights):
        return megamoe_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    return forward
