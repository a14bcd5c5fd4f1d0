"""megamoe: fused Mixture-of-Experts training layer for NVIDIA Hopper (PyTorch binding)."""
from ._lib import MegaMoEError
from .modules import MegaMoEExperts, MoE, megamoe_experts_forward, use_megamoe_experts
from .ops import buffer_sizes, check, fp8_weight_bytes, invalidate_fp8_weights, memory_stats, moe

__all__ = ["MegaMoEError", "MegaMoEExperts", "MoE", "buffer_sizes", "check", "fp8_weight_bytes",
           "invalidate_fp8_weights", "megamoe_experts_forward", "memory_stats", "moe", "use_megamoe_experts"]
__version__ = "0.1.0"
