"""The device memory megamoe takes from PyTorch: each call's scratch, and each
layer's FP8 weights (the only memory it keeps between calls).

Scratch is taken from PyTorch's caching allocator for each call and handed
back when the call's kernels are queued: the allocator gives every layer the
same block (stream-ordered, so reuse is safe), and between megamoe calls the
memory serves other tensors. A persistent per-device buffer kept ~0.9 GiB out
of PyTorch's reach at the peak of a checkpointed step and put the step above
the grouped_mm pipeline's memory (docs/perf-log.md).

FP8 weights: with precision fp8 / fp8_bwd the layer reads its weights in
e4m3, in both orientations, with 128 x 128 block scales (Fp8WeightLayout in
src/core/layer_buffers.h). They are quantised once per optimizer step, not
in every call: the buffer hangs on the caller's w13 tensor and is current
while w13 and w2 keep their storage and version counters and no optimizer has
stepped since it was filled. The step hook is needed because fused
optimizers (AdamW(fused=True)) update parameters without bumping their
version counters. Not seen: writes through `.data` or raw pointers outside an
optimizer step; call invalidate_fp8_weights() after those.

Under torch.compile the look-up cannot be traced (data pointers, version
counters, attributes), so it moves into the ops' bodies, which run eagerly at
run time (`looked_up_fp8_weights`): there bf16 parameters arrive as the
Parameter objects themselves (tests/test_op.py checks it, under aot_eager and
inductor, with checkpointing), and the cache works as in eager mode. Only
Parameters are cached there: weights made in the compiled code (fp32
parameters with bf16 compute) arrive in the compiler's buffers, which it
reuses from layer to layer at the same address and version, so a key on them
could match another layer's weights; those are quantised for the call alone,
as without the cache.
"""
from __future__ import annotations

import ctypes
import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _abi

_LOCK = threading.Lock()
_SCRATCH_PEAK: dict[int, int] = {}  # device index -> largest scratch of one call
_FP8_BYTES = [0]       # bytes of the FP8 weight buffers alive
_FP8_GENERATION = [0]  # bumped after every optimizer step and by invalidate_fp8_weights()


def scratch(device: torch.device, nbytes: int) -> torch.Tensor:
    """One call's scratch, from PyTorch's caching allocator."""
    with _LOCK:
        _SCRATCH_PEAK[device.index] = max(_SCRATCH_PEAK.get(device.index, 0), nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def memory_stats() -> dict:
    """scratch_bytes: the largest scratch one call took (over all devices; not held between calls);
    fp8_weight_bytes: the FP8 weight buffers alive now (all layers and devices; 0 with bf16)."""
    with _LOCK:
        return {"scratch_bytes": max(_SCRATCH_PEAK.values(), default=0), "fp8_weight_bytes": _FP8_BYTES[0]}


# ---- FP8 weights -----------------------------------------------------------------
def _bump_generation(*_args, **_kwargs) -> None:
    _FP8_GENERATION[0] += 1


register_optimizer_step_post_hook(_bump_generation)


def invalidate_fp8_weights() -> None:
    """Marks every layer's FP8 weights stale: the next call quantises them again. Needed only after
    weights change outside an optimizer step without bumping their version counters (e.g. `p.data.copy_`)."""
    _bump_generation()


class _Fp8Weights:
    """One layer's FP8 weight buffer and the state of the weights it was filled from. Not pickled
    (torch.save of a model, copy.deepcopy): it becomes None and is rebuilt at the next call."""
    __slots__ = ("buf", "key", "__weakref__")

    def __init__(self, buf: torch.Tensor):
        self.buf, self.key = buf, None
        with _LOCK:
            _FP8_BYTES[0] += buf.numel()
        weakref.finalize(self, _release_fp8_bytes, buf.numel())

    def __reduce__(self):
        return _no_fp8_weights, ()


def _no_fp8_weights():
    return None


def _release_fp8_bytes(n: int) -> None:
    with _LOCK:
        _FP8_BYTES[0] -= n


@torch.library.custom_op("megamoe::fill_fp8_weights", mutates_args=("fp8_weights",))
def fill_fp8_weights(w13: torch.Tensor, w2: torch.Tensor, fp8_weights: torch.Tensor, precision: str,
                     fp8_scale: str = "fp32") -> None:
    """The layer's FP8 weight buffer from w13 and w2 (bf16, CUDA): e4m3 blocks in both orientations."""
    w13, w2 = w13.contiguous(), w2.contiguous()
    E, I2, H = w13.shape
    cfg = _abi.config(H, I2 // 2, E, 1, precision=precision, fp8_scale=fp8_scale)
    with torch.cuda.device(w13.device):
        stream = torch.cuda.current_stream(w13.device).cuda_stream
        _abi.check(_abi.lib().megamoe_fill_fp8_weights(ctypes.byref(cfg), ctypes.byref(_abi.tensor_desc(w13)),
                                                       ctypes.byref(_abi.tensor_desc(w2)),
                                                       ctypes.byref(_abi.fp8_weights_desc(fp8_weights)), stream))


@fill_fp8_weights.register_fake
def _(w13, w2, fp8_weights, precision, fp8_scale="fp32"):
    return None


def fp8_bytes_of(w13: torch.Tensor, precision: str, fp8_scale: str = "fp32") -> int:
    """FP8 weight bytes of a layer with w13 [E, 2I, H] (weight shapes: static under torch.compile)."""
    if precision not in _abi.FP8_PRECISIONS:
        return 0
    E, I2, H = (int(d) for d in w13.shape)
    return _abi.fp8_weight_bytes(H, I2 // 2, E, 1, precision, fp8_scale)


def filled_fp8_weights(w13: torch.Tensor, w2: torch.Tensor, w13c: torch.Tensor, w2c: torch.Tensor, precision: str,
                       fp8_scale: str, cache: bool) -> tuple[torch.Tensor, bool]:
    """The FP8 weight buffer for a call on the caller's (w13, w2) (w13c, w2c: the same in bf16), filled,
    and whether the layer keeps it (then the backward reads it as it is). It is kept when `cache`, on
    w13, and refilled only when stale. Not kept: cache=False, weights that are inference tensors, and
    under torch.compile (its tracing cannot follow the data-pointer and version checks): a buffer of
    this call's own, filled, which the backward fills again. During CUDA graph capture the fill is
    always captured, so every replay quantises the weights it finds."""
    nbytes = fp8_bytes_of(w13, precision, fp8_scale)
    if not cache or w13.is_inference() or w2.is_inference() or torch.compiler.is_compiling():
        buf = torch.empty(nbytes, dtype=torch.uint8, device=w13.device)
        fill_fp8_weights(w13c, w2c, buf, precision, fp8_scale)
        return buf, False
    key = (precision, fp8_scale, w13.data_ptr(), w13._version, w2.data_ptr(), w2._version, _FP8_GENERATION[0])
    entry = getattr(w13, "_megamoe_fp8", None)
    if entry is None or entry.buf.numel() != nbytes or entry.buf.device != w13.device:
        with torch.inference_mode(False):  # a first call under inference_mode must not make it an inference tensor
            entry = _Fp8Weights(torch.empty(nbytes, dtype=torch.uint8, device=w13.device))
        w13._megamoe_fp8 = entry
    if entry.key != key or torch.cuda.is_current_stream_capturing():
        entry.key = None
        fill_fp8_weights(w13c, w2c, entry.buf, precision, fp8_scale)
        entry.key = key  # only once the fill is queued
    return entry.buf, True


def looked_up_fp8_weights(w13: torch.Tensor, w2: torch.Tensor, precision: str, fp8_scale: str) -> torch.Tensor:
    """Inside an op's body (under torch.compile): the layer's cached FP8 weights, filled if stale; for
    weights that are not Parameters (made in the compiled code) a buffer of this call's own."""
    cache = isinstance(w13, torch.nn.Parameter) and isinstance(w2, torch.nn.Parameter)
    return filled_fp8_weights(w13, w2, w13, w2, precision, fp8_scale, cache)[0]
