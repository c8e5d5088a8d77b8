"""Which tensors of a checkpoint are routed experts, per architecture (docs/SOURCES.md).

Shared experts, routers and dense MLPs never match: DeepSeek's `mlp.shared_experts.*`, Qwen2-MoE's
`mlp.shared_expert.*` and the first_k_dense layers' `mlp.{gate,up,down}_proj` are not `mlp.experts.E`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from moet.formats.source import Projection


@dataclass(frozen=True)
class Scheme:
    """Tensor naming of one architecture's routed experts."""

    prefix: str  # module path of layer L's experts, "{layer}" to fill in
    projections: dict[str, Projection]  # per-expert module name → projection
    fused: bool = False  # also has gpt-oss fused 3-D tensors `<prefix>.{gate_up_proj,down_proj}[_blocks|_scales]`

    @cached_property
    def _head(self) -> str:
        return re.escape(self.prefix).replace(r"\{layer\}", r"(?P<layer>\d+)")

    @cached_property
    def _per_expert(self) -> re.Pattern[str]:
        names = "|".join(map(re.escape, self.projections))
        return re.compile(rf"^{self._head}\.(?P<expert>\d+)\.(?P<proj>{names})\.(?P<suffix>\w+)$")

    @cached_property
    def _fused(self) -> re.Pattern[str]:
        return re.compile(rf"^{self._head}\.(?P<proj>gate_up_proj|down_proj)(?P<suffix>_blocks|_scales|_bias|)$")

    def match_per_expert(self, name: str) -> tuple[int, int, Projection, str] | None:
        """(layer, expert, projection, suffix) of a per-expert tensor name, else None."""
        m = self._per_expert.match(name)
        if m is None:
            return None
        return int(m["layer"]), int(m["expert"]), self.projections[m["proj"]], m["suffix"]

    def match_fused(self, name: str) -> tuple[int, str, str] | None:
        """(layer, "gate_up_proj" | "down_proj", suffix) of a fused 3-D expert tensor, else None."""
        if not self.fused:
            return None
        m = self._fused.match(name)
        return None if m is None else (int(m["layer"]), m["proj"], m["suffix"])

    def module(self, layer: int, expert: int, proj: Projection) -> str:
        """HF per-expert module name, e.g. model.layers.0.mlp.experts.3.down_proj."""
        token = next(t for t, p in self.projections.items() if p == proj)
        return f"{self.prefix.format(layer=layer)}.{expert}.{token}"


_HF_PROJ: dict[str, Projection] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_MLP_EXPERTS = Scheme("model.layers.{layer}.mlp.experts", _HF_PROJ)

SCHEMES: dict[str, Scheme] = {
    "Qwen3MoeForCausalLM": _MLP_EXPERTS,
    "Qwen2MoeForCausalLM": _MLP_EXPERTS,
    "OlmoeForCausalLM": _MLP_EXPERTS,
    "DeepseekV2ForCausalLM": _MLP_EXPERTS,
    "DeepseekV3ForCausalLM": _MLP_EXPERTS,
    "Glm4MoeForCausalLM": _MLP_EXPERTS,
    "MixtralForCausalLM": Scheme("model.layers.{layer}.block_sparse_moe.experts", {"w1": "gate", "w3": "up", "w2": "down"}),
    "GptOssForCausalLM": Scheme("model.layers.{layer}.mlp.experts", _HF_PROJ, fused=True),
}
