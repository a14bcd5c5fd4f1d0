"""megamoe: fused Mixture-of-Experts training layer for NVIDIA Hopper (PyTorch binding)."""
from ._lib import MegaMoEError
from .modules import MegaMoEExperts, MoE, megamoe_experts_forward, use_megamoe_experts
from .ops import Workspace, moe

__all__ = ["MegaMoEError", "MegaMoEExperts", "MoE", "Workspace", "megamoe_experts_forward", "moe",
           "use_megamoe_experts"]
__version__ = "0.1.0"
