"""The MoE layer as a PyTorch custom op with autograd.

    y = megamoe.moe(x, topk_idx, topk_weights, w13, w2)

x [T, H]; topk_idx [T, k] (int32 or int64, -1 = no route); topk_weights
[T, k]; w13 [E, 2I, H] (rows [0, I) gate, [I, 2I) up); w2 [E, H, I].
CUDA tensors (bf16) run the CUDA layer; CPU tensors the C++ reference
(bf16 emulates the GPU's rounding; float32/float64 run exact fp64 math).

Design: two custom ops, megamoe::moe_fwd and megamoe::moe_bwd. The forward
leaves its pools (the saved activations) in a per-layer Workspace together
with the identity of its inputs (storage pointers, shapes, version
counters); the backward uses them when its inputs are those same tensors,
unmodified, and otherwise recomputes the forward first. So both ops stay pure
functions of their inputs for autograd, activation checkpointing and
torch.compile, and the usual case pays for no recomputation.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import weakref

import torch

from . import _lib

# Weak: a Workspace lives as long as its owner (a module, the cache below) keeps it.
_HANDLES: "weakref.WeakValueDictionary[int, Workspace]" = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)
_LOCK = threading.Lock()


class Workspace:
    """One layer's device workspace (or CPU handle), sized once for max_tokens."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *, max_tokens: int,
                 precision: str = "bf16", save: str = "keep", device: torch.device | str = "cpu"):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        for name, value, table in (("precision", precision, _lib.PRECISIONS), ("save", save, _lib.SAVE_POLICIES)):
            if value not in table:
                raise ValueError(f"megamoe: {name}={value!r} is not one of {sorted(table)}")
        cfg = _lib.Config(hidden, intermediate, num_experts, top_k, 0, 1, max_tokens, _lib.PRECISIONS[precision],
                          _lib.SAVE_POLICIES[save], _lib.BACKENDS["cuda" if device.type == "cuda" else "cpu"],
                          (device.index or 0) if device.type == "cuda" else 0)
        handle = ctypes.c_void_p()
        _lib.check(_lib.lib().megamoe_workspace_create(ctypes.byref(cfg), ctypes.byref(handle)))
        self._handle = handle
        self.shape = (hidden, intermediate, num_experts, top_k)
        self.max_tokens, self.precision, self.save, self.device = max_tokens, precision, save, device
        with _LOCK:
            self.id = next(_NEXT_ID)
            _HANDLES[self.id] = self

    @property
    def nbytes(self) -> int:
        """Device bytes held (0 for a CPU handle)."""
        return int(_lib.lib().megamoe_workspace_bytes(self._handle))

    def check_device_errors(self) -> None:
        """Synchronises the current stream; raises if the device found bad routing (ids out of range, duplicates)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else None
        _lib.check(_lib.lib().megamoe_check_device_errors(self._handle, stream))

    def close(self) -> None:
        if self._handle:
            with _LOCK:
                _HANDLES.pop(self.id, None)
            _lib.lib().megamoe_workspace_destroy(self._handle)
            self._handle = ctypes.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _desc(t: torch.Tensor) -> _lib.Tensor:
    if t.dim() > 4:
        raise ValueError(f"megamoe: tensors have at most 4 dims, got {tuple(t.shape)}")
    dtype = str(t.dtype).replace("torch.", "")
    if dtype not in _lib.DTYPE_CODES:
        raise TypeError(f"megamoe: unsupported dtype {t.dtype}")
    shape = (ctypes.c_int64 * 4)(*(list(t.shape) + [0] * (4 - t.dim())))
    return _lib.Tensor(t.data_ptr(), _lib.DTYPE_CODES[dtype], 1 if t.is_cuda else 0,
                       (t.device.index or 0) if t.is_cuda else 0, t.dim(), shape)


def _stream(t: torch.Tensor):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _on_device(t: torch.Tensor):
    # Kernels launch on the current device: make it the tensors' one.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _dense(*tensors: torch.Tensor) -> list[torch.Tensor]:
    # The library reads row-major memory: views with other strides are copied.
    return [t.contiguous() for t in tensors]


def _empty(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _workspace(handle: int) -> Workspace:
    ws = _HANDLES.get(handle)
    if ws is None:
        raise RuntimeError(f"megamoe: workspace {handle} does not exist (closed?)")
    return ws


def _identity(*tensors: torch.Tensor) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version) for t in tensors)


@torch.library.custom_op("megamoe::moe_fwd", mutates_args=())
def moe_fwd(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, handle: int) -> torch.Tensor:
    ws = _workspace(handle)
    x, topk_idx, topk_weights, w13, w2 = _dense(x, topk_idx, topk_weights, w13, w2)
    y = _empty(x)
    epoch = ctypes.c_uint64()
    args = [_desc(t) for t in (x, topk_idx, topk_weights, w13, w2, y)]
    with _on_device(x):
        _lib.check(_lib.lib().megamoe_forward_t(ws._handle, *[ctypes.byref(a) for a in args], _stream(x),
                                                ctypes.byref(epoch)))
    ws._saved = (_identity(x, topk_idx, topk_weights, w13, w2), epoch.value)
    return y


@moe_fwd.register_fake
def _(x, topk_idx, topk_weights, w13, w2, handle):
    return torch.empty_like(x)


@torch.library.custom_op("megamoe::moe_bwd", mutates_args=())
def moe_bwd(dy: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            w13: torch.Tensor, w2: torch.Tensor, handle: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ws = _workspace(handle)
    dy, x, topk_idx, topk_weights, w13, w2 = _dense(dy, x, topk_idx, topk_weights, w13, w2)
    dx, dtw, dw13, dw2 = _empty(x), _empty(topk_weights), _empty(w13), _empty(w2)
    saved_identity, saved_epoch = getattr(ws, "_saved", (None, 0))
    # Epoch 0 never names a forward: the library then recomputes this one first.
    epoch = saved_epoch if saved_identity == _identity(x, topk_idx, topk_weights, w13, w2) else 0
    args = [_desc(t) for t in (x, topk_idx, topk_weights, w13, w2, dy, dx, dtw, dw13, dw2)]
    with _on_device(x):
        _lib.check(_lib.lib().megamoe_backward_t(ws._handle, *[ctypes.byref(a) for a in args], _stream(x), epoch))
    return dx, dtw, dw13, dw2


@moe_bwd.register_fake
def _(dy, x, topk_idx, topk_weights, w13, w2, handle):
    return (torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w13), torch.empty_like(w2))


def _setup_context(ctx, inputs, output):
    x, topk_idx, topk_weights, w13, w2, handle = inputs
    ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2)
    ctx.handle = handle


def _backward(ctx, dy):
    x, topk_idx, topk_weights, w13, w2 = ctx.saved_tensors
    dx, dtw, dw13, dw2 = moe_bwd(dy.contiguous(), x, topk_idx, topk_weights, w13, w2, ctx.handle)
    return dx, None, dtw, dw13, dw2, None


moe_fwd.register_autograd(_backward, setup_context=_setup_context)

_CACHE: dict[tuple, Workspace] = {}


def _cached_workspace(x, w13, top_k, precision, save, max_tokens) -> Workspace:
    # One workspace per (device, shape, precision), grown to the largest token
    # count seen. Layers sharing it recompute their forward in the backward:
    # give each layer its own Workspace (MoE and use_megamoe_experts do).
    E, two_i, H = w13.shape
    key = (x.device, H, two_i // 2, E, top_k, precision, save)
    ws = _CACHE.get(key)
    if ws is None or ws.max_tokens < max_tokens:
        ws = _CACHE[key] = Workspace(H, two_i // 2, E, top_k, max_tokens=max_tokens, precision=precision, save=save,
                                     device=x.device)
    return ws


def moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        *, precision: str = "bf16", save: str = "keep", group=None, workspace: Workspace | None = None,
        max_tokens: int | None = None) -> torch.Tensor:
    """Mixture-of-experts layer: y[t] = sum_j topk_weights[t,j] * w2[e] @ (silu(g) * u), [g; u] = w13[e] @ x[t].

    `workspace` (one per layer, see Workspace) holds the saved activations and
    the device buffers; without one, a workspace cached per (shape, device,
    precision, max_tokens) is used. `group`: expert-parallel process group;
    only a single rank is supported so far.
    """
    if group is not None and getattr(group, "size", lambda: 1)() != 1:
        raise NotImplementedError("megamoe: expert parallelism over several ranks (group size > 1) is not built yet")
    if x.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_weights.shape != topk_idx.shape:
        raise ValueError(f"megamoe: expected x [T, H], topk_idx and topk_weights [T, k]; got {tuple(x.shape)}, "
                         f"{tuple(topk_idx.shape)}, {tuple(topk_weights.shape)}")
    if x.is_cuda and x.dtype != torch.bfloat16:
        raise TypeError(f"megamoe: CUDA tensors must be bfloat16, got {x.dtype}")
    if workspace is None:
        workspace = _cached_workspace(x, w13, topk_idx.shape[1], precision, save, max_tokens or max(1, x.shape[0]))
    orig = x.dtype
    # CPU float32 runs the reference's exact fp64 math; bf16 keeps the GPU's rounding.
    compute = torch.float64 if (not x.is_cuda and orig in (torch.float32, torch.float64)) else torch.bfloat16
    wdtype = torch.float64 if compute == torch.float64 else torch.float32
    # int64 ids are clamped to [-2, E] before narrowing, so a huge id stays out of range (an error), never wraps.
    E = w13.shape[0]
    idx32 = (topk_idx.clamp(-2, E) if topk_idx.dtype == torch.int64 else topk_idx).to(torch.int32)
    y = moe_fwd(x.to(compute).contiguous(), idx32.contiguous(),
                   topk_weights.to(wdtype).contiguous(), w13.to(compute).contiguous(), w2.to(compute).contiguous(),
                   workspace.id)
    return y.to(orig)
