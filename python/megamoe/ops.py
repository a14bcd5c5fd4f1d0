"""The MoE layer as a PyTorch custom op with autograd.

    y = megamoe.moe(x, topk_idx, topk_weights, w13, w2)

x [T, H]; topk_idx [T, k] (int32 or int64, -1 = no route); topk_weights
[T, k]; w13 [E, 2I, H] (rows [0, I) gate, [I, 2I) up); w2 [E, H, I].
CUDA tensors (bf16) run the CUDA layer; CPU tensors the C++ reference
(bf16 emulates the GPU's rounding; float32/float64 run exact fp64 math).

Memory (DESIGN.md section 3): the library keeps no state between calls.
  - The forward op returns, beside y, a `saved` uint8 tensor (the routing
    plan and z) allocated through PyTorch's allocator; autograd saves it with
    the inputs and hands it to the backward op. So activation checkpointing
    frees and recreates it, torch.cuda.max_memory_allocated counts it, and a
    backward can only ever see its own forward's state. It is empty with
    save="recompute", on CPU, and when no gradient is needed (no_grad,
    inference_mode).
  - Scratch (pools, combine slots) is taken from PyTorch's caching allocator
    for the duration of each call: one block, reused by every layer in turn,
    and free for other tensors between calls.
  - FP8 precisions only: each layer's weights in e4m3 (both orientations,
    block scales), quantised once per optimizer step and held between calls
    (fp8_weight_cache=True, the default; see "FP8 weights" below). This is
    the only memory megamoe keeps per layer; memory_stats() reports it.
Errors the kernels find (a bad expert id, a timed-out wait) are raised by the
next megamoe call on that device that starts after the failing kernel ran, by
megamoe.check(), or by the call itself with validate=True / MEGAMOE_CHECK=1.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _lib

_BUFFER_ALIGN = 256
_CPU_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
_CUDA_DTYPES = (torch.bfloat16,)


def _align(n):
    return (n + _BUFFER_ALIGN - 1) // _BUFFER_ALIGN * _BUFFER_ALIGN


def pool_capacity(T, E: int, k: int):
    """Rows of the expert-major pool: align128(T * min(k, E) + 127 * E) (core/layer_buffers.h)."""
    return (T * min(k, E) + 127 * E + 127) // 128 * 128


def saved_bytes(T, H: int, I: int, E: int, k: int):
    """Bytes of the saved buffer (plan + z) of a call of T tokens: the SavedLayout of
    src/core/layer_buffers.h, in Python so that fake tensors (symbolic T) get it too.
    tests check it equals the library's megamoe_buffer_sizes."""
    C = pool_capacity(T, E, k)
    offset = 0
    for size in (8, 4 * E, 4 * (E + 1), 4 * (C // 128), 4 * T * k, 4 * C, 2 * C * 2 * I):
        offset = _align(offset) + size
    return _align(offset)


# The ops below take the numerics as one `recipe` string: the precision, and for
# FP8 with power-of-two block scales "/pow2" after it ("fp8/pow2"), so that the
# op schemas and the FP8 weight cache's key carry the scale mode with it.
def _recipe(precision: str, fp8_scale: str) -> str:
    return f"{precision}/pow2" if fp8_scale == "pow2" else precision


def _precision(recipe: str) -> str:
    return recipe.split("/")[0]


def _config(H: int, I: int, E: int, k: int, recipe: str, save: str, validate: bool) -> _lib.Config:
    precision, _, scale = recipe.partition("/")
    if precision not in _lib.PRECISIONS or scale not in ("", "pow2") or (scale and precision not in ("fp8", "fp8_bwd")):
        raise ValueError(f"megamoe: recipe {recipe!r}: expected a precision of {sorted(_lib.PRECISIONS)}, "
                         "fp8 and fp8_bwd optionally followed by '/pow2'")
    return _lib.Config(H, I, E, k, 0, 1, _lib.PRECISIONS[precision], _lib.SAVE_POLICIES[save],
                       1 if validate else 0, 0, 0, _lib.FP8_SCALES["pow2" if scale else "fp32"], 0)


def buffer_sizes(T: int, H: int, I: int, E: int, k: int, *, precision: str = "bf16", save: str = "keep",
                 will_backward: bool = True) -> tuple[int, int]:
    """(scratch bytes, saved bytes) the library needs for a call of T tokens."""
    scratch, saved = ctypes.c_uint64(), ctypes.c_uint64()
    _lib.check(_lib.lib().megamoe_buffer_sizes(ctypes.byref(_config(H, I, E, k, precision, save, False)), T,
                                               1 if will_backward else 0, ctypes.byref(scratch),
                                               ctypes.byref(saved)))
    return scratch.value, saved.value


# ---- scratch ---------------------------------------------------------------------
# Scratch is taken from PyTorch's caching allocator for each call and handed
# back when the call's kernels are queued: the allocator gives every layer the
# same block (stream-ordered, so reuse is safe), and between megamoe calls the
# memory serves other tensors. Measured on the H200 (docs/perf-log.md): a
# persistent per-device buffer kept ~0.9 GiB out of PyTorch's reach at the
# peak of a checkpointed step and put the step above the grouped_mm pipeline.
_LOCK = threading.Lock()
_SCRATCH_PEAK: dict[int, int] = {}  # device index -> largest scratch of one call


def _scratch(device: torch.device, nbytes: int) -> torch.Tensor:
    with _LOCK:
        _SCRATCH_PEAK[device.index] = max(_SCRATCH_PEAK.get(device.index, 0), nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def memory_stats() -> dict:
    """scratch_bytes: the largest scratch one call took (over all devices; not held between calls);
    fp8_weight_bytes: the FP8 weight buffers alive now (all layers and devices; 0 with bf16)."""
    with _LOCK:
        return {"scratch_bytes": max(_SCRATCH_PEAK.values(), default=0), "fp8_weight_bytes": _FP8_BYTES[0]}


# ---- FP8 weights -----------------------------------------------------------------
# With precision fp8 / fp8_bwd the layer reads its weights in e4m3, in both
# orientations, with 128 x 128 block scales (Fp8WeightLayout in
# src/core/layer_buffers.h). They are quantised once per optimizer step, not
# in every call: the buffer hangs on the caller's w13 tensor and is current
# while w13 and w2 keep their storage and version counters and no optimizer
# has stepped since it was filled. The step hook is needed because fused
# optimizers (AdamW(fused=True)) update parameters without bumping their
# version counters. Not seen: writes through `.data` or raw pointers outside
# an optimizer step; call invalidate_fp8_weights() after those.
# Under torch.compile the look-up cannot be traced (data pointers, version
# counters, attributes), so it moves into the ops' bodies, which run eagerly
# at run time (`fp8_lookup`): there bf16 parameters arrive as the Parameter
# objects themselves (tests/test_op.py checks it, under aot_eager and
# inductor, with checkpointing), and the cache works as in eager mode. Only
# Parameters are cached there: weights made in the compiled code (fp32
# parameters with bf16 compute) arrive in the compiler's buffers, which it
# reuses from layer to layer at the same address and version, so a key on
# them could match another layer's weights; those are quantised for the
# call alone, as without the cache.
_FP8_BYTES = [0]      # bytes of the FP8 weight buffers alive
_FP8_GENERATION = [0]  # bumped after every optimizer step and by invalidate_fp8_weights()


def _bump_generation(*_args, **_kwargs) -> None:
    _FP8_GENERATION[0] += 1


register_optimizer_step_post_hook(_bump_generation)


def invalidate_fp8_weights() -> None:
    """Marks every layer's FP8 weights stale: the next call quantises them again. Needed only after
    weights change outside an optimizer step without bumping their version counters (e.g. `p.data.copy_`)."""
    _bump_generation()


@functools.lru_cache(maxsize=256)
def fp8_weight_bytes(H: int, I: int, E: int, k: int, precision: str) -> int:
    """Bytes of one layer's FP8 weight buffer (0 for bf16)."""
    n = ctypes.c_uint64()
    _lib.check(_lib.lib().megamoe_fp8_weight_bytes(ctypes.byref(_config(H, I, E, k, precision, "keep", False)),
                                                   ctypes.byref(n)))
    return n.value


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


def _filled_fp8_weights(w13: torch.Tensor, w2: torch.Tensor, w13c: torch.Tensor, w2c: torch.Tensor, precision: str,
                        nbytes: int, cache: bool) -> tuple[torch.Tensor, bool]:
    """The FP8 weight buffer for a call on the caller's (w13, w2) (w13c, w2c: the same in bf16), filled,
    and whether the layer keeps it (then the backward reads it as it is). It is kept when `cache`, on
    w13, and refilled only when stale. Not kept: cache=False, weights that are inference tensors, and
    under torch.compile (its tracing cannot follow the data-pointer and version checks): a buffer of
    this call's own, filled, which the backward fills again. During CUDA graph capture the fill is
    always captured, so every replay quantises the weights it finds."""
    if not cache or w13.is_inference() or w2.is_inference() or torch.compiler.is_compiling():
        buf = torch.empty(nbytes, dtype=torch.uint8, device=w13.device)
        fill_fp8_weights(w13c, w2c, buf, precision)
        return buf, False
    key = (precision, w13.data_ptr(), w13._version, w2.data_ptr(), w2._version, _FP8_GENERATION[0])
    entry = getattr(w13, "_megamoe_fp8", None)
    if entry is None or entry.buf.numel() != nbytes or entry.buf.device != w13.device:
        with torch.inference_mode(False):  # a first call under inference_mode must not make it an inference tensor
            entry = _Fp8Weights(torch.empty(nbytes, dtype=torch.uint8, device=w13.device))
        w13._megamoe_fp8 = entry
    if entry.key != key or torch.cuda.is_current_stream_capturing():
        entry.key = None
        fill_fp8_weights(w13c, w2c, entry.buf, precision)
        entry.key = key  # only once the fill is queued
    return entry.buf, True


def _fp8_bytes(w13: torch.Tensor, precision: str) -> int:
    """FP8 weight bytes of a layer with w13 [E, 2I, H] (weight shapes: static under torch.compile)."""
    if _precision(precision) not in ("fp8", "fp8_bwd"):
        return 0
    E, I2, H = (int(d) for d in w13.shape)
    return fp8_weight_bytes(H, I2 // 2, E, 1, precision)


def _fp8_desc(buf: torch.Tensor) -> _lib.Fp8Weights:
    """A filled FP8 weight buffer for the C ABI (ready: the ops never fill it themselves)."""
    if buf.numel() == 0:
        return _lib.Fp8Weights(None, 0, 0)
    return _lib.Fp8Weights(buf.data_ptr(), buf.numel(), 1)


def check(device: torch.device | str | int | None = None) -> None:
    """Waits for the current stream of `device` (default: the current CUDA device)
    and raises MegaMoEError for any error the kernels found there."""
    if not torch.cuda.is_available():
        return
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else (
        torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index).cuda_stream
    _lib.check(_lib.lib().megamoe_check(index, stream))


# ---- the ops --------------------------------------------------------------------
def _desc(t: torch.Tensor) -> _lib.Tensor:
    dtype = str(t.dtype).replace("torch.", "")
    shape = (ctypes.c_int64 * 4)(*(list(t.shape) + [0] * (4 - t.dim())))
    return _lib.Tensor(t.data_ptr(), _lib.DTYPE_CODES[dtype], 1 if t.is_cuda else 0,
                       (t.device.index or 0) if t.is_cuda else 0, t.dim(), shape)


def _buffer(t: torch.Tensor | None) -> _lib.Buffer:
    return _lib.Buffer(None, 0) if t is None or t.numel() == 0 else _lib.Buffer(t.data_ptr(), t.numel())


def _dims(x: torch.Tensor, topk_idx: torch.Tensor, w13: torch.Tensor) -> tuple[int, int, int, int]:
    E, two_i, H = w13.shape
    return H, two_i // 2, E, topk_idx.shape[1]


def _validate_flag(validate: bool) -> bool:
    return validate or os.environ.get("MEGAMOE_CHECK", "0") not in ("", "0")


def _ids_as_int32(topk_idx: torch.Tensor, E: int) -> torch.Tensor:
    """int32 ids for the library. int64 ids on the CPU are checked here, so that an id beyond int32 is reported
    with its own value; on CUDA (no host sync) they saturate to the int32 limits, which are out of range too and
    which the device error names as such."""
    if topk_idx.dtype == torch.int32:
        return topk_idx
    if not topk_idx.is_cuda:
        bad = ((topk_idx < -1) | (topk_idx >= E)).reshape(-1).nonzero()
        if bad.numel():
            t, j = divmod(int(bad[0]), topk_idx.shape[1])
            raise _lib.MegaMoEError(f"InvalidArgument: topk_idx[{t},{j}] = {int(topk_idx[t, j])} is out of range "
                                    f"[-1, num_experts = {E})")
    return topk_idx.clamp(-(2 ** 31), 2 ** 31 - 1).to(torch.int32)


@torch.library.custom_op("megamoe::fill_fp8_weights", mutates_args=("fp8_weights",))
def fill_fp8_weights(w13: torch.Tensor, w2: torch.Tensor, fp8_weights: torch.Tensor, precision: str) -> None:
    """The layer's FP8 weight buffer from w13 and w2 (bf16, CUDA): e4m3 blocks in both orientations."""
    w13, w2 = w13.contiguous(), w2.contiguous()
    E, I2, H = w13.shape
    cfg = _config(H, I2 // 2, E, 1, precision, "keep", False)
    with torch.cuda.device(w13.device):
        stream = torch.cuda.current_stream(w13.device).cuda_stream
        _lib.check(_lib.lib().megamoe_fill_fp8_weights(ctypes.byref(cfg), ctypes.byref(_desc(w13)),
                                                       ctypes.byref(_desc(w2)),
                                                       ctypes.byref(_fp8_desc(fp8_weights)), stream))


@fill_fp8_weights.register_fake
def _(w13, w2, fp8_weights, precision):
    return None


def _looked_up_fp8_weights(w13: torch.Tensor, w2: torch.Tensor, precision: str) -> torch.Tensor:
    """Inside an op's body (fp8_lookup): the layer's cached FP8 weights, filled if stale; for weights
    that are not Parameters (made in the compiled code) a buffer of this call's own."""
    cache = isinstance(w13, torch.nn.Parameter) and isinstance(w2, torch.nn.Parameter)
    return _filled_fp8_weights(w13, w2, w13, w2, precision, _fp8_bytes(w13, precision), cache)[0]


@torch.library.custom_op("megamoe::moe_fwd", mutates_args=())
def moe_fwd(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, fp8_weights: torch.Tensor, fp8_kept: bool, precision: str, save_state: bool,
            validate: bool, fp8_lookup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_weights: the layer's FP8 weight buffer, filled (empty for bf16); fp8_kept: the layer keeps it
    after this call (so the backward reads it), else the backward fills one of its own. fp8_lookup (under
    torch.compile, CUDA, fp8 / fp8_bwd): fp8_weights is empty and the layer's cache is looked up here, and
    again by the backward."""
    if fp8_lookup and x.is_cuda and _precision(precision) == "fp8":  # fp8_bwd's forward reads none
        fp8_weights = _looked_up_fp8_weights(w13, w2, precision)
    x, topk_idx, topk_weights, w13, w2 = (t.contiguous() for t in (x, topk_idx, topk_weights, w13, w2))
    H, I, E, k = _dims(x, topk_idx, w13)
    T = x.shape[0]
    topk_idx = _ids_as_int32(topk_idx, E)
    keep = save_state and x.is_cuda
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    saved = torch.empty(saved_bytes(T, H, I, E, k) if keep else 0, dtype=torch.uint8, device=x.device)
    cfg = _config(H, I, E, k, precision, "keep" if keep else "recompute", _validate_flag(validate))
    scratch = None
    with torch.cuda.device(x.device) if x.is_cuda else _nullcontext():
        if x.is_cuda:
            scratch_need, saved_need = buffer_sizes(T, H, I, E, k, precision=precision,
                                                    save="keep" if keep else "recompute", will_backward=keep)
            assert saved_need == saved.numel(), (saved_need, saved.numel())  # the Python layout mirrors the C++ one
            scratch = _scratch(x.device, scratch_need)
        args = [_desc(t) for t in (x, topk_idx, topk_weights, w13, w2, y)]
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None
        _lib.check(_lib.lib().megamoe_forward(ctypes.byref(cfg), *[ctypes.byref(a) for a in args],
                                              ctypes.byref(_buffer(saved)), ctypes.byref(_buffer(scratch)),
                                              ctypes.byref(_fp8_desc(fp8_weights)), stream))
    return y, saved


@moe_fwd.register_fake
def _(x, topk_idx, topk_weights, w13, w2, fp8_weights, fp8_kept, precision, save_state, validate, fp8_lookup=False):
    H, I, E, k = _dims(x, topk_idx, w13)
    keep = save_state and x.device.type == "cuda"
    n = saved_bytes(x.shape[0], H, I, E, k) if keep else 0
    return torch.empty_like(x), x.new_empty(n, dtype=torch.uint8)


@torch.library.custom_op("megamoe::moe_bwd", mutates_args=())
def moe_bwd(dy: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            w13: torch.Tensor, w2: torch.Tensor, saved: torch.Tensor, fp8_weights: torch.Tensor, precision: str,
            validate: bool, fp8_lookup: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if fp8_lookup and x.is_cuda and _precision(precision) in ("fp8", "fp8_bwd"):  # the forward's again: no refill
        fp8_weights = _looked_up_fp8_weights(w13, w2, precision)
    dy, x, topk_idx, topk_weights, w13, w2 = (t.contiguous() for t in (dy, x, topk_idx, topk_weights, w13, w2))
    H, I, E, k = _dims(x, topk_idx, w13)
    T = x.shape[0]
    topk_idx = _ids_as_int32(topk_idx, E)
    dx, dtw = torch.empty_like(x), torch.empty_like(topk_weights)
    dw13, dw2 = torch.empty_like(w13), torch.empty_like(w2)
    keep = saved.numel() > 0
    cfg = _config(H, I, E, k, precision, "keep" if keep else "recompute", _validate_flag(validate))
    scratch = None
    with torch.cuda.device(x.device) if x.is_cuda else _nullcontext():
        if x.is_cuda:
            scratch = _scratch(x.device, buffer_sizes(T, H, I, E, k, precision=precision,
                                                      save="keep" if keep else "recompute")[0])
        args = [_desc(t) for t in (x, topk_idx, topk_weights, w13, w2, dy, dx, dtw, dw13, dw2)]
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None
        _lib.check(_lib.lib().megamoe_backward(ctypes.byref(cfg), *[ctypes.byref(a) for a in args],
                                               ctypes.byref(_buffer(saved)), ctypes.byref(_buffer(scratch)),
                                               ctypes.byref(_fp8_desc(fp8_weights)), stream))
    return dx, dtw, dw13, dw2


@moe_bwd.register_fake
def _(dy, x, topk_idx, topk_weights, w13, w2, saved, fp8_weights, precision, validate, fp8_lookup=False):
    return (torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w13), torch.empty_like(w2))


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _setup_context(ctx, inputs, output):
    x, topk_idx, topk_weights, w13, w2, fp8_weights, fp8_kept, precision, save_state, validate, fp8_lookup = inputs
    ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2, output[1])
    ctx.precision, ctx.validate, ctx.fp8_lookup = precision, validate, fp8_lookup
    # FP8 weights: a kept buffer is current for the backward (autograd runs it before any optimizer
    # step); it is held as a plain reference, not saved: a later forward of the same layer may
    # refill it (same weights), which bumps its version. A buffer of the forward's own is not held:
    # the backward fills one of its own.
    ctx.fp8_weights = fp8_weights if fp8_kept and fp8_weights.numel() > 0 else None
    ctx.fp8_bytes = _fp8_bytes(w13, precision) if x.is_cuda else 0
    # No zero-filled gradient for `saved` (uint8, hundreds of MB): autograd
    # would write one on every backward (measured: 134 us of 7.7 ms at 30B).
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _dsaved):
    if dy is None:  # y did not reach the loss: nothing flows back
        return (None,) * 11
    x, topk_idx, topk_weights, w13, w2, saved = ctx.saved_tensors
    fp8_weights = ctx.fp8_weights  # kept by the layer: current
    if ctx.fp8_lookup:  # the op looks the layer's buffer up itself
        fp8_weights = x.new_empty(0, dtype=torch.uint8)
    elif fp8_weights is None:  # bf16 (empty), or a buffer of this call's own, filled here
        fp8_weights = x.new_empty(ctx.fp8_bytes, dtype=torch.uint8)
        if ctx.fp8_bytes > 0:
            fill_fp8_weights(w13, w2, fp8_weights, ctx.precision)
    dx, dtw, dw13, dw2 = moe_bwd(dy.contiguous(), x, topk_idx, topk_weights, w13, w2, saved, fp8_weights,
                                 ctx.precision, ctx.validate, ctx.fp8_lookup)
    return dx, None, dtw, dw13, dw2, None, None, None, None, None, None


moe_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    in megamoe/ops.py); False: quantise them in every forward and backward and
    keep nothing. Not kept (as False) for inference tensors, nor under
    torch.compile for weights that are not Parameters when they reach the
    op (fp32 parameters converted to bf16 in the compiled code); under CUDA
    graph capture the quantisation is captured.
    fp8_scale (fp8 / fp8_bwd): the block scales, "fp32" (amax / 448) or "pow2"
    (the power of two at or above it; then kDownGrad's epilogue quantises dz,
    without a pass over it).
    """
    for name, value, table in (("precision", precision, _lib.PRECISIONS), ("save", save, _lib.SAVE_POLICIES),
                               ("fp8_scale", fp8_scale, _lib.FP8_SCALES)):
        if value not in table:
            raise ValueError(f"megamoe: {name}={value!r} is not one of {sorted(table)}")
    if fp8_scale != "fp32" and precision not in ("fp8", "fp8_bwd"):
        raise ValueError(f"megamoe: fp8_scale={fp8_scale!r} needs precision 'fp8' or 'fp8_bwd' (got {precision!r})")
    _check_shapes(x, topk_idx, topk_weights, w13, w2)
    _check_dtypes(x, topk_idx, topk_weights, w13, w2)
    if group is not None and getattr(group, "size", lambda: 1)() != 1:
        if save != "keep":
            raise NotImplementedError("megamoe: expert parallelism runs save='keep' (its backward needs the "
                                      "forward's routing plan)")
        if precision == "mxfp8":
            raise NotImplementedError("megamoe: precision 'mxfp8' needs Blackwell tensor cores; expert parallelism "
                                      "runs CUDA only")
        from .ep import moe_ep
        return moe_ep(x, topk_idx, topk_weights, w13, w2, group, max_tokens=max_tokens, validate=validate,
                      recipe=_recipe(precision, fp8_scale), fp8_weight_cache=fp8_weight_cache)
    orig = x.dtype
    # CPU float32 runs the reference's exact fp64 math; bf16 keeps the GPU's rounding.
    compute = torch.float64 if (not x.is_cuda and orig in (torch.float32, torch.float64)) else torch.bfloat16
    wdtype = torch.float64 if compute == torch.float64 else torch.float32
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w13, w2))
    w13c, w2c = w13.to(compute), w2.to(compute)
    fp8_weights, fp8_kept = x.new_empty(0, dtype=torch.uint8), False
    # fp8 reads the FP8 weights in the forward; fp8_bwd only in its backward (filled here if kept).
    recipe = _recipe(precision, fp8_scale)
    # Under torch.compile the ops look the cache up themselves (see "FP8 weights" above).
    fp8_lookup = (x.is_cuda and fp8_weight_cache and precision in ("fp8", "fp8_bwd") and
                  torch.compiler.is_compiling())
    if x.is_cuda and not fp8_lookup and (precision == "fp8" or
                                         (precision == "fp8_bwd" and fp8_weight_cache and needs_grad)):
        fp8_weights, fp8_kept = _filled_fp8_weights(w13, w2, w13c, w2c, recipe,
                                                    _fp8_bytes(w13, recipe), fp8_weight_cache)
    y, _ = moe_fwd(x.to(compute), topk_idx, topk_weights.to(wdtype), w13c, w2c, fp8_weights, fp8_kept,
                   recipe, needs_grad and save == "keep", validate, fp8_lookup)
    return y.to(orig)
