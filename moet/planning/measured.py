"""The measured constants a decode prediction rests on, each read from the bench result that measured it.

All GPU figures come from the H200 (the only GPU this project has run on), at batch 1:
- the 2-bit MoE layer's achieved bandwidth (bytes of the step's active experts / time), per kernel
  geometry, from `moet bench kernels`;
- the rest of a decoder layer (attention, norms, router, shared expert) and the LM head, from
  `moet bench e2e --compile` on its DeepSeek-V4-Flash stand-in: the per-layer step time minus the
  MoE kernels' own time in the kernels run;
- the device cache's batched host→device fetch, from the H200 tier check;
- pack reads from disk, from `moet bench tiers` on the 2-core development VM (its disk, not an NVMe).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moet.bench.e2e import FRONTIER
from moet.errors import MoetError

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
KERNELS = "kernels-20261203T121135Z.json"
E2E = "e2e-20261203T123521Z-compiled.json"
GPU_TIERS = "gpu_tiers-h200-20261202.json"
TIERS = "tiers-20261202T154733Z.json"
STAND_IN = "deepseek-v4-flash"  # the e2e model whose layer time is measured


@dataclass(frozen=True)
class Constant:
    value: float
    unit: str
    source: str  # bench/results/<file>: what in it

    def describe(self, name: str) -> str:
        return f"{name} {self.value:.4g} {self.unit} ({self.source})"


@dataclass(frozen=True)
class Measured:
    moe_gbs: dict[str, tuple[int, Constant]]  # geometry → (bytes per active expert, achieved GB/s at T=1)
    layer_other_us: Constant
    head_us: Constant
    head_bytes: int  # the stand-in's LM head, which head_us read
    fetch_gbs: Constant
    pack_read_gbs: Constant

    def moe_bandwidth(self, expert_bytes: int) -> Constant:
        """The 2-bit MoE bandwidth measured on the geometry whose experts are closest in size."""
        return min(self.moe_gbs.values(), key=lambda item: abs(item[0] - expert_bytes))[1]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _load(name: str) -> dict[str, Any]:
    path = RESULTS / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MoetError(f"{path}: cannot read the measured constants ({exc}); run from a moet source tree") from None


def measured() -> Measured:
    """Read the constants; MoetError when the result files are not there (an installed wheel has no bench/)."""
    kernels = _load(KERNELS)
    decode = {(r["geometry"], r["tokens"]): r for r in kernels["records"] if r.get("kind") == "decode" and r.get("variant") == "base"}
    moe = {}
    for (geometry, tokens), r in decode.items():
        if tokens == 1:
            source = f"bench/results/{KERNELS}: {geometry} T=1 base, {r['bytes'] / 1e6:.1f} MB in {r['us']:.1f} µs"
            moe[geometry] = (int(r["bytes"] / r["active_experts"]), Constant(r["gbs"], "GB/s", source))
    e2e = _load(E2E)["models"][STAND_IN]
    layer_us, kernel_us = e2e["projection"]["base_layer_us"], decode[(STAND_IN, 1)]["us"]
    other = Constant(layer_us - kernel_us, "µs/layer",
                     f"bench/results/{E2E}: {STAND_IN} base_layer_us {layer_us:.1f} − {KERNELS} base {kernel_us:.1f}")
    head = Constant(e2e["head_us_b1"], "µs", f"bench/results/{E2E}: {STAND_IN} head_us_b1")
    stand_in = FRONTIER[STAND_IN]
    fetch = _load(GPU_TIERS)["fetch"]
    boot = _load(TIERS)["boot"]
    return Measured(
        moe_gbs=moe, layer_other_us=other, head_us=head, head_bytes=2 * stand_in["vocab"] * stand_in["hidden"],
        fetch_gbs=Constant(fetch["fetch_gbps"], "GB/s", f"bench/results/{GPU_TIERS}: fetch.fetch_gbps (pinned host → H200)"),
        pack_read_gbs=Constant(boot["pack_read_gbps"], "GB/s", f"bench/results/{TIERS}: boot.pack_read_gbps (dev VM disk)"),
    )
