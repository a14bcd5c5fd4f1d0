"""ctypes binding of the C ABI (include/megamoe/c_api.h).

Why ctypes over a TORCH_LIBRARY extension: the shared library is built once
against no particular torch (no torch headers, no ABI tag), so one build works
with any torch version the trainer brings; torch integration lives in Python
(torch.library.custom_op), which is the stable surface across versions.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

DTYPE_CODES = {"bfloat16": 0, "float32": 1, "float64": 2, "int32": 3}
PRECISIONS = {"bf16": 0, "fp8": 1, "fp8_bwd": 2, "mxfp8": 3}
SAVE_POLICIES = {"keep": 0, "recompute": 1}
FP8_SCALES = {"fp32": 0, "pow2": 1}  # the FP8 block scales: amax / 448, or the power of two above it
BACKENDS = {"cpu": 0, "cuda": 1, "auto": 2}


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
        G = P  # megamoe_ep_group* (the struct lives in megamoe.ep)
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
