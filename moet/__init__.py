"""moet: 2-bit routed experts, an FP4 tier and tiered expert residency for MoE serving on vLLM."""

__version__ = "0.1.0"
