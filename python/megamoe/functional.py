"""The public functions: the MoE layer as one call, with autograd.

    y = megamoe.moe(x, topk_idx, topk_weights, w13, w2)

x [T, H]; topk_idx [T, k] (int32 or int64, -1 = no route); topk_weights
[T, k]; w13 [E, 2I, H] (rows [0, I) gate, [I, 2I) up); w2 [E, H, I].
CUDA tensors (bf16) run the CUDA layer; CPU tensors the C++ reference
(bf16 emulates the GPU's rounding; float32/float64 run exact fp64 math).

Memory (docs/design.md): the library keeps no state between calls.
  - The forward keeps what its backward needs (the routing plan and z) in a
    tensor autograd saves (megamoe._ops): activation checkpointing frees and
    recreates it, torch.cuda.max_memory_allocated counts it.
  - Scratch (pools, combine slots) is taken from PyTorch's caching allocator
    for the duration of each call: one block, reused by every layer in turn,
    and free for other tensors between calls (megamoe._memory).
  - FP8 precisions only: each layer's weights in e4m3 (both orientations,
    block scales), quantised once per optimizer step and held between calls
    (fp8_weight_cache=True, the default; megamoe._memory). This is the only
    memory megamoe keeps per layer; memory_stats() reports it.
Errors the kernels find (a bad expert id, a timed-out wait) are raised by the
next megamoe call on that device that starts after the failing kernel ran, by
megamoe.check(), or by the call itself with validate=True / MEGAMOE_CHECK=1.
"""
from __future__ import annotations

import torch

from . import _abi, _memory, _ops, ep

_CPU_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
_CUDA_DTYPES = (torch.bfloat16,)


def check(device: torch.device | str | int | None = None) -> None:
    """Waits for the current stream of `device` (default: the current CUDA device)
    and raises MegaMoEError for any error the kernels found there."""
    if not torch.cuda.is_available():
        return
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else (
        torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index).cuda_stream
    _abi.check(_abi.lib().megamoe_check(index, stream))


def _check_shapes(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"megamoe: x: expected [T, H], got shape {list(x.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_weights.shape != topk_idx.shape:
        raise ValueError(f"megamoe: topk_idx and topk_weights: expected [T, k] with T = {x.shape[0]} (x's rows), got "
                         f"{list(topk_idx.shape)} and {list(topk_weights.shape)}")
    for name, w, layout in (("w13", w13, "[E, 2I, H]"), ("w2", w2, "[E, H, I]")):
        if w.dim() != 3:
            raise ValueError(f"megamoe: {name}: expected 3 dims {layout}, got shape {list(w.shape)}")
    H = x.shape[1]
    E, _, I = w2.shape
    if tuple(w2.shape[:2]) != (w13.shape[0], H):
        raise ValueError(f"megamoe: w2: expected [E, H, I] = [{w13.shape[0]}, {H}, I] (E from w13, H from x), "
                         f"got {list(w2.shape)}")
    if tuple(w13.shape) != (E, 2 * I, H):
        raise ValueError(f"megamoe: w13: expected [E, 2I, H] = [{E}, {2 * I}, {H}] (I = {I} from w2 {list(w2.shape)}, "
                         f"H from x), got {list(w13.shape)}")


def _check_dtypes(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor) -> None:
    """The dtypes megamoe computes in (see the module docstring); anything else is refused, never coerced."""
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"megamoe: topk_idx: expected int32 or int64 expert ids, got {topk_idx.dtype} "
                        "(float or bool ids are refused rather than truncated)")
    x_ok = _CUDA_DTYPES if x.is_cuda else _CPU_DTYPES
    if x.dtype not in x_ok:
        raise TypeError(f"megamoe: x: dtype {x.dtype} is not supported on {x.device.type}: expected "
                        f"{' or '.join(str(d).replace('torch.', '') for d in x_ok)}"
                        + (" (float16 would be computed with bfloat16 rounding: convert it explicitly)"
                           if x.dtype == torch.float16 else ""))
    for name, t in (("topk_weights", topk_weights), ("w13", w13), ("w2", w2)):
        if t.dtype not in _CPU_DTYPES:
            raise TypeError(f"megamoe: {name}: expected a bfloat16, float32 or float64 tensor, got {t.dtype}")
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights), ("w13", w13), ("w2", w2)):
        if t.device != x.device:
            raise ValueError(f"megamoe: {name} is on {t.device} but x is on {x.device}: every tensor must be on one device")


def moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        *, precision: str = "bf16", save: str = "keep", group=None, max_tokens: int | None = None,
        validate: bool = False, fp8_weight_cache: bool = True, fp8_scale: str = "fp32") -> torch.Tensor:
    """Mixture-of-experts layer: y[t] = sum_j topk_weights[t,j] * w2[e] @ (silu(g) * u), [g; u] = w13[e] @ x[t].

    Dtypes: x bfloat16 (CUDA; CPU too, emulating the GPU's rounding) or float32 / float64 (CPU: exact fp64
    math); topk_idx int32 or int64; topk_weights, w13, w2 any of bfloat16 / float32 / float64, converted to
    x's compute dtype (fp32 for the routing weights), as autocast would. Anything else is a TypeError.
    save: "keep" (the backward reuses the forward's routing plan and z, held in a
    tensor autograd saves) or "recompute" (nothing beyond the inputs is saved).
    validate (or env MEGAMOE_CHECK=1): synchronise and raise device-found errors
    in this call. `group`: expert-parallel process group; with several ranks, w13
    and w2 are this rank's E / P experts and the call is megamoe.ep's (CUDA,
    save="keep", bf16 / fp8 / fp8_bwd; max_tokens: the most tokens any rank
    brings, agreed at the first call by default).
    fp8_weight_cache (fp8 / fp8_bwd on CUDA): keep this layer's weights in e4m3
    between calls, quantised again only after they change (see "FP8 weights"
    in megamoe/_memory.py); False: quantise them in every forward and backward and
    keep nothing. Not kept (as False) for inference tensors, nor under
    torch.compile for weights that are not Parameters when they reach the
    op (fp32 parameters converted to bf16 in the compiled code); under CUDA
    graph capture the quantisation is captured.
    fp8_scale (fp8 / fp8_bwd): the block scales, "fp32" (amax / 448) or "pow2"
    (the power of two at or above it; then kDownGrad's epilogue quantises dz,
    without a pass over it).
    """
    _abi.check_option("precision", precision)
    _abi.check_option("save", save)
    _abi.check_fp8_scale(precision, fp8_scale)
    _check_shapes(x, topk_idx, topk_weights, w13, w2)
    _check_dtypes(x, topk_idx, topk_weights, w13, w2)
    if group is not None and getattr(group, "size", lambda: 1)() != 1:
        if save != "keep":
            raise NotImplementedError("megamoe: expert parallelism runs save='keep' (its backward needs the "
                                      "forward's routing plan)")
        if precision == "mxfp8":
            raise NotImplementedError("megamoe: precision 'mxfp8' needs Blackwell tensor cores; expert parallelism "
                                      "runs CUDA only")
        return ep.moe_ep(x, topk_idx, topk_weights, w13, w2, group, max_tokens=max_tokens, validate=validate,
                         precision=precision, fp8_scale=fp8_scale, fp8_weight_cache=fp8_weight_cache)
    orig = x.dtype
    # CPU float32 runs the reference's exact fp64 math; bf16 keeps the GPU's rounding.
    compute = torch.float64 if (not x.is_cuda and orig in (torch.float32, torch.float64)) else torch.bfloat16
    wdtype = torch.float64 if compute == torch.float64 else torch.float32
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w13, w2))
    w13c, w2c = w13.to(compute), w2.to(compute)
    fp8_weights, fp8_kept = x.new_empty(0, dtype=torch.uint8), False
    # fp8 reads the FP8 weights in the forward; fp8_bwd only in its backward (filled here if kept).
    # Under torch.compile the ops look the cache up themselves (megamoe._memory, "FP8 weights").
    fp8_lookup = (x.is_cuda and fp8_weight_cache and precision in _abi.FP8_PRECISIONS and
                  torch.compiler.is_compiling())
    if x.is_cuda and not fp8_lookup and (precision == "fp8" or
                                         (precision == "fp8_bwd" and fp8_weight_cache and needs_grad)):
        fp8_weights, fp8_kept = _memory.filled_fp8_weights(w13, w2, w13c, w2c, precision, fp8_scale,
                                                           fp8_weight_cache)
    y, _ = _ops.moe_fwd(x.to(compute), topk_idx, topk_weights.to(wdtype), w13c, w2c, fp8_weights, fp8_kept,
                        precision, needs_grad and save == "keep", validate, fp8_lookup, fp8_scale)
    return y.to(orig)
