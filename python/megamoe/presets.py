"""Model presets, read from the library (include/megamoe/presets.h is their one definition).

PRESETS[name] holds the Qwen3MoeConfig keyword arguments of that preset's shapes.
"""
from __future__ import annotations

import ctypes

from . import _abi


def _read() -> dict[str, dict]:
    lib = _abi.lib()
    count = ctypes.c_int32()
    info = _abi.PresetInfo()
    _abi.check(lib.megamoe_preset(0, ctypes.byref(info), ctypes.byref(count)))
    out = {}
    for i in range(count.value):
        _abi.check(lib.megamoe_preset(i, ctypes.byref(info), None))
        out[info.name.decode()] = dict(hidden_size=info.hidden, moe_intermediate_size=info.intermediate,
                                       num_experts=info.num_experts, num_experts_per_tok=info.top_k,
                                       num_attention_heads=info.attention_heads,
                                       num_key_value_heads=info.kv_heads, head_dim=info.head_dim)
    return out


PRESETS = _read()
