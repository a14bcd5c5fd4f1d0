"""The one-GPU (and CPU reference) layer as PyTorch custom ops with autograd:
megamoe::moe_fwd and megamoe::moe_bwd over the C ABI.

The forward op returns, beside y, a `saved` uint8 tensor (the routing plan and
z) allocated through PyTorch's allocator; autograd saves it with the inputs
and hands it to the backward op. So activation checkpointing frees and
recreates it, torch.cuda.max_memory_allocated counts it, and a backward can
only ever see its own forward's state. It is empty with save="recompute", on
CPU, and when no gradient is needed (no_grad, inference_mode).
"""
from __future__ import annotations

import contextlib
import ctypes

import torch

from . import _abi, _memory


def dims(x: torch.Tensor, topk_idx: torch.Tensor, w13: torch.Tensor) -> tuple[int, int, int, int]:
    """(H, I, E, k) of a call."""
    E, two_i, H = w13.shape
    return H, two_i // 2, E, topk_idx.shape[1]


def ids_as_int32(topk_idx: torch.Tensor, E: int) -> torch.Tensor:
    """int32 ids for the library. int64 ids on the CPU are checked here, so that an id beyond int32 is reported
    with its own value; on CUDA (no host sync) they saturate to the int32 limits, which are out of range too and
    which the device error names as such."""
    if topk_idx.dtype == torch.int32:
        return topk_idx
    if not topk_idx.is_cuda:
        bad = ((topk_idx < -1) | (topk_idx >= E)).reshape(-1).nonzero()
        if bad.numel():
            t, j = divmod(int(bad[0]), topk_idx.shape[1])
            raise _abi.MegaMoEError(f"InvalidArgument: topk_idx[{t},{j}] = {int(topk_idx[t, j])} is out of range "
                                    f"[-1, num_experts = {E})")
    return topk_idx.clamp(-(2 ** 31), 2 ** 31 - 1).to(torch.int32)


def _on_device(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _stream(x: torch.Tensor):
    return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None


@torch.library.custom_op("megamoe::moe_fwd", mutates_args=())
def moe_fwd(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, fp8_weights: torch.Tensor, fp8_kept: bool, precision: str, save_state: bool,
            validate: bool, fp8_lookup: bool = False, fp8_scale: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_weights: the layer's FP8 weight buffer, filled (empty for bf16); fp8_kept: the layer keeps it
    after this call (so the backward reads it), else the backward fills one of its own. fp8_lookup (under
    torch.compile, CUDA, fp8 / fp8_bwd): fp8_weights is empty and the layer's cache is looked up here, and
    again by the backward."""
    if fp8_lookup and x.is_cuda and precision == "fp8":  # fp8_bwd's forward reads none
        fp8_weights = _memory.looked_up_fp8_weights(w13, w2, precision, fp8_scale)
    x, topk_idx, topk_weights, w13, w2 = (t.contiguous() for t in (x, topk_idx, topk_weights, w13, w2))
    H, I, E, k = dims(x, topk_idx, w13)
    T = x.shape[0]
    topk_idx = ids_as_int32(topk_idx, E)
    keep = save_state and x.is_cuda
    save = "keep" if keep else "recompute"
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    saved = torch.empty(_abi.saved_bytes(T, H, I, E, k) if keep else 0, dtype=torch.uint8, device=x.device)
    cfg = _abi.config(H, I, E, k, precision=precision, fp8_scale=fp8_scale, save=save,
                      validate=_abi.validate_flag(validate))
    scratch = None
    with _on_device(x):
        if x.is_cuda:
            scratch_need, saved_need = _abi.buffer_sizes(T, H, I, E, k, precision=precision, fp8_scale=fp8_scale,
                                                         save=save, will_backward=keep)
            assert saved_need == saved.numel(), (saved_need, saved.numel())  # the Python layout mirrors the C++ one
            scratch = _memory.scratch(x.device, scratch_need)
        args = [_abi.tensor_desc(t) for t in (x, topk_idx, topk_weights, w13, w2, y)]
        _abi.check(_abi.lib().megamoe_forward(ctypes.byref(cfg), *[ctypes.byref(a) for a in args],
                                              ctypes.byref(_abi.buffer_desc(saved)),
                                              ctypes.byref(_abi.buffer_desc(scratch)),
                                              ctypes.byref(_abi.fp8_weights_desc(fp8_weights)), _stream(x)))
    return y, saved


@moe_fwd.register_fake
def _(x, topk_idx, topk_weights, w13, w2, fp8_weights, fp8_kept, precision, save_state, validate, fp8_lookup=False,
      fp8_scale="fp32"):
    H, I, E, k = dims(x, topk_idx, w13)
    keep = save_state and x.device.type == "cuda"
    n = _abi.saved_bytes(x.shape[0], H, I, E, k) if keep else 0
    return torch.empty_like(x), x.new_empty(n, dtype=torch.uint8)


@torch.library.custom_op("megamoe::moe_bwd", mutates_args=())
def moe_bwd(dy: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            w13: torch.Tensor, w2: torch.Tensor, saved: torch.Tensor, fp8_weights: torch.Tensor, precision: str,
            validate: bool, fp8_lookup: bool = False,
            fp8_scale: str = "fp32") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if fp8_lookup and x.is_cuda and precision in _abi.FP8_PRECISIONS:  # the forward's again: no refill
        fp8_weights = _memory.looked_up_fp8_weights(w13, w2, precision, fp8_scale)
    dy, x, topk_idx, topk_weights, w13, w2 = (t.contiguous() for t in (dy, x, topk_idx, topk_weights, w13, w2))
    H, I, E, k = dims(x, topk_idx, w13)
    T = x.shape[0]
    topk_idx = ids_as_int32(topk_idx, E)
    dx, dtw = torch.empty_like(x), torch.empty_like(topk_weights)
    dw13, dw2 = torch.empty_like(w13), torch.empty_like(w2)
    save = "keep" if saved.numel() > 0 else "recompute"
    cfg = _abi.config(H, I, E, k, precision=precision, fp8_scale=fp8_scale, save=save,
                      validate=_abi.validate_flag(validate))
    scratch = None
    with _on_device(x):
        if x.is_cuda:
            need = _abi.buffer_sizes(T, H, I, E, k, precision=precision, fp8_scale=fp8_scale, save=save)[0]
            scratch = _memory.scratch(x.device, need)
        args = [_abi.tensor_desc(t) for t in (x, topk_idx, topk_weights, w13, w2, dy, dx, dtw, dw13, dw2)]
        _abi.check(_abi.lib().megamoe_backward(ctypes.byref(cfg), *[ctypes.byref(a) for a in args],
                                               ctypes.byref(_abi.buffer_desc(saved)),
                                               ctypes.byref(_abi.buffer_desc(scratch)),
                                               ctypes.byref(_abi.fp8_weights_desc(fp8_weights)), _stream(x)))
    return dx, dtw, dw13, dw2


@moe_bwd.register_fake
def _(dy, x, topk_idx, topk_weights, w13, w2, saved, fp8_weights, precision, validate, fp8_lookup=False,
      fp8_scale="fp32"):
    return (torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w13), torch.empty_like(w2))


def _setup_context(ctx, inputs, output):
    (x, topk_idx, topk_weights, w13, w2, fp8_weights, fp8_kept, precision, save_state, validate, fp8_lookup,
     fp8_scale) = inputs
    ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2, output[1])
    ctx.precision, ctx.fp8_scale, ctx.validate, ctx.fp8_lookup = precision, fp8_scale, validate, fp8_lookup
    # FP8 weights: a kept buffer is current for the backward (autograd runs it before any optimizer
    # step); it is held as a plain reference, not saved: a later forward of the same layer may
    # refill it (same weights), which bumps its version. A buffer of the forward's own is not held:
    # the backward fills one of its own.
    ctx.fp8_weights = fp8_weights if fp8_kept and fp8_weights.numel() > 0 else None
    ctx.fp8_bytes = _memory.fp8_bytes_of(w13, precision, fp8_scale) if x.is_cuda else 0
    # No zero-filled gradient for `saved` (uint8, hundreds of MB): autograd
    # would write one on every backward (measured: 134 us of 7.7 ms at 30B).
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _dsaved):
    if dy is None:  # y did not reach the loss: nothing flows back
        return (None,) * 12
    x, topk_idx, topk_weights, w13, w2, saved = ctx.saved_tensors
    fp8_weights = ctx.fp8_weights  # kept by the layer: current
    if ctx.fp8_lookup:  # the op looks the layer's buffer up itself
        fp8_weights = x.new_empty(0, dtype=torch.uint8)
    elif fp8_weights is None:  # bf16 (empty), or a buffer of this call's own, filled here
        fp8_weights = x.new_empty(ctx.fp8_bytes, dtype=torch.uint8)
        if ctx.fp8_bytes > 0:
            _memory.fill_fp8_weights(w13, w2, fp8_weights, ctx.precision, ctx.fp8_scale)
    dx, dtw, dw13, dw2 = moe_bwd(dy.contiguous(), x, topk_idx, topk_weights, w13, w2, saved, fp8_weights,
                                 ctx.precision, ctx.validate, ctx.fp8_lookup, ctx.fp8_scale)
    return dx, None, dtw, dw13, dw2, None, None, None, None, None, None, None


moe_fwd.register_autograd(_backward, setup_context=_setup_context)
