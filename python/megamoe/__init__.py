"""megamoe: fused Mixture-of-Experts training layer for NVIDIA Hopper (PyTorch binding).

Modules, each importing only those above it: _abi (the C ABI: library,
structs, options, sizes), _memory (scratch and the FP8 weight cache), _ops
(the one-GPU custom ops), peer and ep (expert parallelism), functional (the
public functions), modules (nn.Modules, the Hugging Face drop-in), presets,
train (the trainer).
"""
from ._abi import MegaMoEError, buffer_sizes, fp8_weight_bytes
from ._memory import invalidate_fp8_weights, memory_stats
from .functional import check, moe
from .modules import MegaMoEExperts, MoE, megamoe_experts_forward, use_megamoe_experts

__all__ = ["MegaMoEError", "MegaMoEExperts", "MoE", "buffer_sizes", "check", "fp8_weight_bytes",
           "invalidate_fp8_weights", "megamoe_experts_forward", "memory_stats", "moe", "use_megamoe_experts"]
__version__ = "0.1.0"
