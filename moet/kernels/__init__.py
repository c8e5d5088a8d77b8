"""GPU kernels for the MoE forward over stacked 2-bit / FP4 expert weights (Triton; see docs/KERNELS.md).

Importing this package needs torch only; Triton is imported by the submodules that launch kernels.
"""

from moet.kernels.layout import Fp4Slots, StackedWeights

__all__ = ["Fp4Slots", "StackedWeights", "default_configs", "fused_moe_2bit", "new_workspace", "select_experts"]


def __getattr__(name: str):
    """Lazy access to the Triton-backed entry points, so CPU-only imports never need Triton."""
    if name in ("fused_moe_2bit", "new_workspace", "default_configs"):
        from moet.kernels import moe

        return getattr(moe, name)
    if name == "select_experts":
        from moet.kernels.glue import select_experts

        return select_experts
    raise AttributeError(name)
