"""Checkpoint formats: validated safetensors reading, discovery, routed-expert streaming, exporters (docs/SOURCES.md)."""

from moet.formats.experts import RoutedExperts, iter_routed_experts
from moet.formats.source import ExpertKey, SourceWeight

__all__ = ["ExpertKey", "RoutedExperts", "SourceWeight", "iter_routed_experts"]
