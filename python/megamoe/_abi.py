"""The C ABI (include/megamoe/c_api.h) through ctypes: the library, its
structs, the option table, the config builder, tensor descriptors and buffer
sizes. The bottom of the package: it imports no other megamoe module.

Why ctypes over a TORCH_LIBRARY extension: the shared library is built once
against no particular torch (no torch headers, no ABI tag), so one build works
with any torch version the trainer brings; torch integration lives in Python
(torch.library.custom_op), which is the stable surface across versions.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

DTYPE_CODES = {"bfloat16": 0, "float32": 1, "float64": 2, "int32": 3}
BACKENDS = {"cpu": 0, "cuda": 1, "auto": 2}
# The numerics and memory options of a call, with their C ABI codes: written
# here once, read by the config builder, the public functions' checks and the modules.
OPTIONS = {
    "precision": {"bf16": 0, "fp8": 1, "fp8_bwd": 2, "mxfp8": 3},
    "save": {"keep": 0, "recompute": 1},
    # The FP8 block scales: amax / 448, or the power of two at or above it.
    "fp8_scale": {"fp32": 0, "pow2": 1},
}
FP8_PRECISIONS = ("fp8", "fp8_bwd")
BUFFER_ALIGN = 256


def check_option(name: str, value: str) -> None:
    """Raises ValueError naming the option unless `value` is one of its choices."""
    if value not in OPTIONS[name]:
        raise ValueError(f"megamoe: {name}={value!r} is not one of {sorted(OPTIONS[name])}")


def check_fp8_scale(precision: str, fp8_scale: str) -> None:
    check_option("fp8_scale", fp8_scale)
    if fp8_scale != "fp32" and precision not in FP8_PRECISIONS:
        raise ValueError(f"megamoe: fp8_scale={fp8_scale!r} needs precision 'fp8' or 'fp8_bwd' (got {precision!r})")


class MegaMoEError(RuntimeError):
    """An error reported by the megamoe core; the message names the argument."""


class Config(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
        ("num_experts", ctypes.c_int32), ("top_k", ctypes.c_int32),
        ("ep_rank", ctypes.c_int32), ("ep_size", ctypes.c_int32),
        ("precision", ctypes.c_int32), ("save_policy", ctypes.c_int32),
        ("validate", ctypes.c_int32), ("accumulate_wgrad", ctypes.c_int32),
        ("device_timeout_ms", ctypes.c_int64),
        ("fp8_scale", ctypes.c_int32), ("cuda_paths", ctypes.c_int32),
    ]


class Fp8Weights(ctypes.Structure):  # megamoe_fp8_weights
    _fields_ = [("data", ctypes.c_void_p), ("bytes", ctypes.c_uint64), ("ready", ctypes.c_int32)]


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("device", ctypes.c_int32),
        ("device_index", ctypes.c_int32), ("rank", ctypes.c_int32), ("shape", ctypes.c_int64 * 4),
    ]


class Buffer(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("bytes", ctypes.c_uint64)]


class PresetInfo(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p), ("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
        ("num_experts", ctypes.c_int32), ("top_k", ctypes.c_int32), ("attention_heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
    ]


def _candidates() -> list[Path]:
    here = Path(__file__).resolve().parent
    out = []
    if os.environ.get("MEGAMOE_LIBRARY"):  # named explicitly: that file or an error, never another copy
        return [Path(os.environ["MEGAMOE_LIBRARY"])]
    out.append(here / "libmegamoe_c.so")                      # installed wheel
    out.append(here.parent.parent / "build" / "libmegamoe_c.so")  # source checkout
    return out


def _load() -> ctypes.CDLL:
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.exists():
            lib = ctypes.CDLL(str(path))
            break
    else:
        raise ImportError("megamoe: libmegamoe_c.so not found (tried " + ", ".join(tried) +
                          "); install with `pip install .` or set MEGAMOE_LIBRARY")
    try:
        P, C, T, B = ctypes.c_void_p, ctypes.POINTER(Config), ctypes.POINTER(Tensor), ctypes.POINTER(Buffer)
        U64 = ctypes.POINTER(ctypes.c_uint64)
        lib.megamoe_buffer_sizes.argtypes = [C, ctypes.c_int64, ctypes.c_int32, U64, U64]
        W = ctypes.POINTER(Fp8Weights)
        lib.megamoe_fp8_weight_bytes.argtypes = [C, U64]
        lib.megamoe_fill_fp8_weights.argtypes = [C, T, T, W, P]
        lib.megamoe_forward.argtypes = [C] + [T] * 6 + [B, B, W, P]
        lib.megamoe_backward.argtypes = [C] + [T] * 10 + [B, B, W, P]
        lib.megamoe_check.argtypes = [ctypes.c_int32, P]
        G = P  # megamoe_ep_group* (EpGroup below)
        lib.megamoe_ep_sizes.argtypes = [C, ctypes.c_int64, ctypes.c_int32, U64, U64, U64, U64]
        lib.megamoe_ep_forward.argtypes = [C, G] + [T] * 6 + [B, B, W, P]
        lib.megamoe_ep_backward.argtypes = [C, G] + [T] * 10 + [B, B, W, P]
        lib.megamoe_cuda_available.argtypes = [ctypes.POINTER(ctypes.c_char_p)]
        lib.megamoe_preset.argtypes = [ctypes.c_int32, ctypes.POINTER(PresetInfo), ctypes.POINTER(ctypes.c_int32)]
        lib.megamoe_peer_check.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, P, P, ctypes.c_uint64, P,
                                           ctypes.POINTER(ctypes.c_int64)]
        lib.megamoe_last_error.restype = ctypes.c_char_p
    except AttributeError as e:  # a symbol this package calls is missing: a library from another version
        raise ImportError(f"megamoe: {path} does not match this Python package ({e}); rebuild it "
                          "(cmake --build build, or pip install .)") from None
    return lib


_LIB = None


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        _LIB = _load()
    return _LIB


def check(code: int) -> None:
    if code != 0:
        raise MegaMoEError(lib().megamoe_last_error().decode())


# ---- the config, descriptors and sizes --------------------------------------------
def config(H: int, I: int, E: int, k: int, *, precision: str = "bf16", fp8_scale: str = "fp32", save: str = "keep",
           validate: bool = False, rank: int = 0, world: int = 1, timeout_ms: int = 0) -> Config:
    """The megamoe_config of a layer call (validated by the library)."""
    check_option("precision", precision)
    check_option("save", save)
    check_fp8_scale(precision, fp8_scale)
    return Config(H, I, E, k, rank, world, OPTIONS["precision"][precision], OPTIONS["save"][save],
                  1 if validate else 0, 0, timeout_ms, OPTIONS["fp8_scale"][fp8_scale], 0)


def validate_flag(validate: bool) -> bool:
    """validate, or the environment's MEGAMOE_CHECK=1."""
    return validate or os.environ.get("MEGAMOE_CHECK", "0") not in ("", "0")


def tensor_desc(t: torch.Tensor) -> Tensor:
    dtype = str(t.dtype).replace("torch.", "")
    shape = (ctypes.c_int64 * 4)(*(list(t.shape) + [0] * (4 - t.dim())))
    return Tensor(t.data_ptr(), DTYPE_CODES[dtype], 1 if t.is_cuda else 0, (t.device.index or 0) if t.is_cuda else 0,
                  t.dim(), shape)


def buffer_desc(t: torch.Tensor | None) -> Buffer:
    return Buffer(None, 0) if t is None or t.numel() == 0 else Buffer(t.data_ptr(), t.numel())


def fp8_weights_desc(buf: torch.Tensor) -> Fp8Weights:
    """A filled FP8 weight buffer (ready: the ops never fill it themselves)."""
    if buf.numel() == 0:
        return Fp8Weights(None, 0, 0)
    return Fp8Weights(buf.data_ptr(), buf.numel(), 1)


def _align(n):
    return (n + BUFFER_ALIGN - 1) // BUFFER_ALIGN * BUFFER_ALIGN


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


def buffer_sizes(T: int, H: int, I: int, E: int, k: int, *, precision: str = "bf16", fp8_scale: str = "fp32",
                 save: str = "keep", will_backward: bool = True) -> tuple[int, int]:
    """(scratch bytes, saved bytes) the library needs for a call of T tokens."""
    scratch, saved = ctypes.c_uint64(), ctypes.c_uint64()
    cfg = config(H, I, E, k, precision=precision, fp8_scale=fp8_scale, save=save)
    check(lib().megamoe_buffer_sizes(ctypes.byref(cfg), T, 1 if will_backward else 0, ctypes.byref(scratch),
                                     ctypes.byref(saved)))
    return scratch.value, saved.value


@functools.lru_cache(maxsize=256)
def fp8_weight_bytes(H: int, I: int, E: int, k: int, precision: str, fp8_scale: str = "fp32") -> int:
    """Bytes of one layer's FP8 weight buffer (0 for bf16)."""
    n = ctypes.c_uint64()
    check(lib().megamoe_fp8_weight_bytes(ctypes.byref(config(H, I, E, k, precision=precision, fp8_scale=fp8_scale)),
                                         ctypes.byref(n)))
    return n.value


def ep_sizes(H: int, I: int, E: int, k: int, world: int, max_tokens: int, *, will_backward: bool = True,
             precision: str = "bf16", fp8_scale: str = "fp32") -> dict:
    """Bytes of the symmetric buffer and EP scratch (per group and device) and of one call's scratch and saved."""
    out = [ctypes.c_uint64() for _ in range(4)]
    cfg = config(H, I, E, k, precision=precision, fp8_scale=fp8_scale, world=world)
    check(lib().megamoe_ep_sizes(ctypes.byref(cfg), max_tokens, 1 if will_backward else 0,
                                 *[ctypes.byref(o) for o in out]))
    return dict(zip(("symmetric", "ep_scratch", "scratch", "saved"), (o.value for o in out)))


class EpGroup(ctypes.Structure):  # megamoe_ep_group
    _fields_ = [
        ("local", ctypes.c_void_p), ("peers", ctypes.c_void_p), ("bytes", ctypes.c_uint64),
        ("max_tokens", ctypes.c_int64), ("ep_scratch", Buffer), ("epoch", ctypes.c_uint32),
    ]
