"""Expert parallelism from PyTorch: `megamoe.moe(..., group=pg)` with pg of 2 to 8 ranks.

Each rank passes its own tokens and its E / P experts' weights (w13 [E/P, 2I, H],
w2 [E/P, H, I]); rank r holds experts [r E/P, (r + 1) E/P) and topk_idx holds
global expert ids. The ranks meet on the device, through one symmetric buffer
per (group, device, H, k, max_tokens) (megamoe.peer), never on the host: the
kernels wait for each other, bounded by the device timeout, and a rank that
never comes is named in the error raised at the next megamoe call or check.

What every rank must do alike: call the same layers in the same order (each
forward takes one epoch of its buffer, each backward two; activation
checkpointing re-runs forwards on every rank alike), and agree on max_tokens,
the most tokens any rank brings to one call. By default it is agreed once, at
the first call on a buffer, as the largest token count of that call over the
group (one all_reduce, a host sync then and only then); pass max_tokens to
fix it instead. A call with more tokens is an error naming the limit.

The forward keeps what the backward needs in a tensor autograd saves (the
owner's routing plan, z, and its routes' weights); y, dx, d topk_w, dW13 and
dW2 are bitwise those of one GPU running the whole batch (src/cuda/layer/ep_layer.h),
in bf16 and in FP8 (fp8 / fp8_bwd: the owners' GEMMs in e4m3 with this rank's
experts' FP8 weights, cached as on one GPU; fp8's forward sends its rows in
e4m3 with their scales, the backward's rows are bf16).
CUDA, save="keep" only.

Limits, and what goes wrong otherwise:
  - No CUDA-graph capture and no torch.compile tracing through it (refused /
    a graph break): a captured call would replay its epoch, and the waits,
    which pass on flag >= epoch, would read another call's data.
  - All calls on a buffer run in host order on one stream per rank.
  - After an error in a call, this rank's buffer is marked out of step and
    every later call on it raises: the ranks' epoch counters may differ.
  - The device waits give up after MEGAMOE_EP_TIMEOUT_MS (default 600000, as
    NCCL's 10 minutes: ranks drift apart for checkpoints and evaluation).
  - Memory: the owner's pool, slots and saved state are sized for the worst
    case (every rank's max_tokens tokens routed to this rank), P times the
    one-GPU sizes at the same max_tokens.
"""
from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field

import torch

from . import _abi, _memory, peer


@dataclass
class _Shared:
    """One symmetric buffer and what goes with it on this rank."""
    buffer: peer.SymmetricBuffer
    ep_scratch: torch.Tensor
    max_tokens: int
    epoch: int = 0
    broken: str = ""  # why this buffer is out of step (a call failed on this rank)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, n: int) -> int:
        """The first of n fresh epochs."""
        with self.lock:
            if self.broken:
                raise _abi.MegaMoEError(f"megamoe.ep: this rank's expert-parallel buffer is out of step since an "
                                        f"earlier call failed ({self.broken}); the group must be rebuilt")
            first = self.epoch + 1
            self.epoch += n
            return first

    def struct(self, epoch: int) -> _abi.EpGroup:
        b = self.buffer
        return _abi.EpGroup(b.tensor.data_ptr(), b.peers_device_ptr, b.nbytes, self.max_tokens,
                            _abi.Buffer(self.ep_scratch.data_ptr(), self.ep_scratch.numel()), epoch)


_SHARED: dict[tuple, _Shared] = {}
_SHARED_LOCK = threading.Lock()


def _timeout_ms() -> int:
    return int(os.environ.get("MEGAMOE_EP_TIMEOUT_MS", "600000"))


def _config(H: int, I: int, E: int, k: int, rank: int, world: int, validate: bool, precision: str,
            fp8_scale: str) -> _abi.Config:
    return _abi.config(H, I, E, k, precision=precision, fp8_scale=fp8_scale, validate=validate, rank=rank,
                       world=world, timeout_ms=_timeout_ms())


def _shared(group, device: torch.device, H: int, I: int, E: int, k: int, T: int, max_tokens) -> _Shared:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    key = (getattr(group, "group_name", id(group)), device.index, H, k, max_tokens)
    with _SHARED_LOCK:
        s = _SHARED.get(key)
    if s is not None:
        return s
    if max_tokens is None:  # agreed once per buffer: the largest token count of this first call
        t = torch.tensor([T], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        agreed = int(t.item())
    else:
        agreed = int(max_tokens)
    need = _abi.ep_sizes(H, I, E, k, world, agreed)
    buf = peer.symmetric_buffer(need["symmetric"], group)  # collective, on the current device (x's)
    buf.tensor.zero_()
    scratch = torch.zeros(need["ep_scratch"], dtype=torch.uint8, device=device)
    # Every rank's flags are zero before any rank's first call writes them (a
    # collective on this device's stream, after the zeroing).
    done = torch.ones(1, device=device)
    dist.all_reduce(done, group=group)
    torch.cuda.current_stream(device).synchronize()
    s = _Shared(buf, scratch, agreed)
    with _SHARED_LOCK:
        _SHARED[key] = s
    return s


def _call(shared: _Shared, fn, *args) -> None:
    """One C ABI call; a failure marks this rank's buffer out of step (the ranks' epochs may differ now)."""
    try:
        _abi.check(fn(*args))
    except _abi.MegaMoEError as e:
        shared.broken = str(e)
        raise


class _EpMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w13, w2, group, max_tokens, validate, keep, precision, fp8_scale,
                fp8_weights, fp8_kept):
        import torch.distributed as dist

        x, topk_weights, w13, w2 = (t.contiguous() for t in (x, topk_weights, w13, w2))
        topk_idx = topk_idx.contiguous().clamp(-(2 ** 31), 2 ** 31 - 1).to(torch.int32)
        T, H = x.shape
        L, two_i, _ = w13.shape
        I, k = two_i // 2, topk_idx.shape[1]
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        E = L * world
        with torch.cuda.device(x.device):
            shared = _shared(group, x.device, H, I, E, k, T, max_tokens)
        if T > shared.max_tokens:
            # The other ranks will wait for this one in vain: this rank's buffer is out of step now.
            shared.broken = f"{T} tokens on rank {rank} > max_tokens = {shared.max_tokens}"
            raise _abi.MegaMoEError(f"CapacityError: {T} tokens on rank {rank}, but this group's buffer holds "
                                    f"max_tokens = {shared.max_tokens} (pass max_tokens= to megamoe.moe or the "
                                    f"module; the other ranks' calls time out)")
        need = _abi.ep_sizes(H, I, E, k, world, shared.max_tokens, will_backward=keep, precision=precision,
                             fp8_scale=fp8_scale)
        y = torch.empty_like(x)
        saved = torch.empty(need["saved"], dtype=torch.uint8, device=x.device)
        cfg = _config(H, I, E, k, rank, world, _abi.validate_flag(validate), precision, fp8_scale)
        with torch.cuda.device(x.device):
            scratch = _memory.scratch(x.device, need["scratch"])
            grp = shared.struct(shared.take(1))
            args = [_abi.tensor_desc(t) for t in (x, topk_idx, topk_weights, w13, w2, y)]
            _call(shared, _abi.lib().megamoe_ep_forward, ctypes.byref(cfg), ctypes.byref(grp),
                  *[ctypes.byref(a) for a in args], ctypes.byref(_abi.buffer_desc(saved)),
                  ctypes.byref(_abi.buffer_desc(scratch)), ctypes.byref(_abi.fp8_weights_desc(fp8_weights)),
                  torch.cuda.current_stream(x.device).cuda_stream)
        ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2, saved)
        ctx.shared, ctx.cfg, ctx.need, ctx.precision, ctx.fp8_scale = shared, cfg, need, precision, fp8_scale
        # FP8 weights: as the one-GPU op (megamoe._ops), a buffer the layer keeps is current for the
        # backward; one of the forward's own is not held, the backward fills another.
        ctx.fp8_weights = fp8_weights if fp8_kept and fp8_weights.numel() > 0 else None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, topk_idx, topk_weights, w13, w2, saved = ctx.saved_tensors
        if saved.numel() == 0:
            raise RuntimeError("megamoe: this forward kept nothing for a backward")
        dy = dy.contiguous()
        dx, dtw = torch.empty_like(x), torch.empty_like(topk_weights)
        dw13, dw2 = torch.empty_like(w13), torch.empty_like(w2)  # bf16, as the one-GPU op writes them
        fp8_weights = ctx.fp8_weights
        if fp8_weights is None:  # bf16 (empty), or FP8 not kept by the layer: this rank's experts, filled here
            fp8_weights = x.new_empty(_memory.fp8_bytes_of(w13, ctx.precision, ctx.fp8_scale), dtype=torch.uint8)
            if fp8_weights.numel() > 0:
                _memory.fill_fp8_weights(w13, w2, fp8_weights, ctx.precision, ctx.fp8_scale)
        with torch.cuda.device(x.device):
            scratch = _memory.scratch(x.device, ctx.need["scratch"])
            grp = ctx.shared.struct(ctx.shared.take(2))
            args = [_abi.tensor_desc(t) for t in (x, topk_idx, topk_weights, w13, w2, dy, dx, dtw, dw13, dw2)]
            _call(ctx.shared, _abi.lib().megamoe_ep_backward, ctypes.byref(ctx.cfg), ctypes.byref(grp),
                  *[ctypes.byref(a) for a in args], ctypes.byref(_abi.buffer_desc(saved)),
                  ctypes.byref(_abi.buffer_desc(scratch)), ctypes.byref(_abi.fp8_weights_desc(fp8_weights)),
                  torch.cuda.current_stream(x.device).cuda_stream)
        return dx, None, dtw, dw13, dw2, None, None, None, None, None, None, None, None


@torch._dynamo.disable
def moe_ep(x, topk_idx, topk_weights, w13, w2, group, *, max_tokens=None, validate: bool = False,
           precision: str = "bf16", fp8_scale: str = "fp32", fp8_weight_cache: bool = True) -> torch.Tensor:
    """The expert-parallel layer (see the module docstring); called by megamoe.moe(group=...), which
    has checked the options."""
    if not x.is_cuda:
        raise ValueError("megamoe: expert parallelism (group of several ranks) runs CUDA tensors only")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"megamoe: expert parallelism needs bfloat16 x, got {x.dtype}")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("megamoe: expert parallelism cannot be captured in a CUDA graph (a replay would reuse "
                           "the call's epoch and read another call's data)")
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w13, w2))
    w13c, w2c = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    # This rank's experts' FP8 weights, as the one-GPU op takes them: fp8 reads them in the forward,
    # fp8_bwd in its backward only (filled here when the layer keeps them).
    fp8_weights, fp8_kept = x.new_empty(0, dtype=torch.uint8), False
    if precision == "fp8" or (precision == "fp8_bwd" and fp8_weight_cache and keep):
        fp8_weights, fp8_kept = _memory.filled_fp8_weights(w13, w2, w13c, w2c, precision, fp8_scale,
                                                           fp8_weight_cache)
    return _EpMoE.apply(x, topk_idx, topk_weights.to(torch.float32), w13c, w2c, group, max_tokens, validate, keep,
                        precision, fp8_scale, fp8_weights, fp8_kept)
