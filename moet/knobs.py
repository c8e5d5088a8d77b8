"""Every VLLM_MOE_W2* knob, defined once: its type, default and meaning.

The plugin reads them from the environment (`Knobs.from_env`), the YAML model list sets the same
fields by their short names (`delta_gb: 8`), and the supervisor writes them back with `to_env`.
Unknown names and malformed values are start-up errors, never silent defaults; so are knobs that
conflict (CONFLICTS), knobs set where they would do nothing (NEEDS), and knobs the device cannot
serve (`Knobs.check_placement`): each one line naming both settings. Every tier works per rank under
tensor and expert parallelism (docs/STORE.md), so no rule depends on the parallelism.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moet.errors import ConfigError
from moet.tier.gate import parse_tau

PREFIX = "VLLM_MOE_W2"
Auto = Literal["auto"]


class Knobs(BaseModel):
    """The runtime settings of the 2-bit MoE path (env name = VLLM_MOE_W2_<FIELD>, `w2` = VLLM_MOE_W2)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    w2: bool = Field(False, description="Claim routed experts and serve them from the 2-bit base.")
    delta_gb: Union[float, Auto] = Field(
        0.0, description="FP4 tier pool in GiB; 'auto' = free memory after the KV cache minus a reserve; 0 = off."
    )
    fp4_tier: Literal["refine", "planes"] = Field(
        "refine", description="How the FP4 tier is stored: base-5 refinement of the base (2.5 b/w) or whole planes (4 b/w)."
    )
    gate: bool = Field(False, description="Confidence gate: re-run low-confidence decode steps with FP4 experts.")
    gate_tau: str = Field(
        "0.60", description="Gate threshold on the top-1 probability, or 'budget:F' to fire on about F of decode steps."
    )
    gate_tau_file: str | None = Field(None, description="File whose contents override gate_tau at run time.")
    gate_fp_max: int = Field(3, ge=1, le=16, description="Most re-run passes of one gated step.")
    gate_promote_max: int = Field(0, ge=0, description="Most experts promoted per gated step (0 = no limit).")
    store_dir: str | None = Field(None, description="Directory of per-rank pack files (persistent quantization cache).")
    store_threads: int = Field(4, ge=1, le=64, description="Reader threads of the pack store.")
    base_cache_gb: float = Field(0.0, ge=0, description="Device expert cache in GiB over a host store; 0 = fully resident.")
    base_ram_gb: Union[float, Auto] = Field(0.0, description="Pinned host arena over the pack in GiB, or 'auto'; 0 = off.")
    tier_direct: bool = Field(False, description="Read packs with O_DIRECT.")
    drop_source_pages: bool = Field(
        True, description="Drop a shard's page-cache pages once a layer's experts are read (posix_fadvise DONTNEED)."
    )
    zero_mode: Literal["auto", "sign", "parity"] = Field(
        "auto", description="Zero nibbles' base sign: auto (sign bit unless ≥95% share one sign, then k parity)."
    )
    replay_mode: Literal["strict", "approximate"] = Field(
        "strict", description="strict: fail a request whose misses persist after fp_max passes; approximate: answer with zeroed experts (logged)."
    )
    cache_miss: Literal["replay", "cpu", "both"] = Field(
        "replay", description="A device-cache miss: replay the step after fetching it (graph-safe, bit-identical); cpu: compute it on the host from the store, beside the GPU's resident experts (eager only); both: split the misses between the two by their measured rates."
    )
    fp_max: int = Field(4, ge=1, le=64, description="Most replay passes of one step under the base cache.")
    base_miss_tol: int = Field(0, ge=0, description="Misses tolerated per step without replay (degraded, logged).")
    kpi_secs: float = Field(30.0, gt=0, description="Seconds between KPI log lines.")
    prefill_fp8: bool = Field(
        False, description="Prefill on sm_90 GPUs (the Gluon kernel) through FP8 wgmma: the 2-bit base experts' inputs in e4m3 with one scale per token; on an H100 0.95-1.09× the default bf16 prefill's speed (faster only near 8,192 tokens), KL +0.9% on the embedded model (docs/KERNELS.md)."
    )

    @field_validator("delta_gb", "base_ram_gb")
    @classmethod
    def _non_negative(cls, value: float | str) -> float | str:
        if value != "auto" and float(value) < 0:
            raise ValueError("must be a size in GiB ≥ 0 or 'auto'")
        return value

    @field_validator("gate_tau")
    @classmethod
    def _tau(cls, value: str) -> str:
        parse_tau(value)
        return value

    @model_validator(mode="after")
    def _combinations(self) -> "Knobs":
        for knob, other in CONFLICTS:
            if self._set(knob) and self._set(other):
                raise ValueError(f"{self.setting(knob)} and {self.setting(other)} do not work together: {CONFLICTS[knob, other]}")
        return self

    def check_effective(self) -> None:
        """Refuse a knob set where it would do nothing (NEEDS); raises ValueError naming both knobs.
        Applied to what users write (the environment, the model list), not to knobs built in code."""
        for knob, (needed, why) in NEEDS.items():
            if self._set(knob) and not any(self._set(n) for n in needed):
                names = " or ".join(self.env_name(n) for n in needed)
                raise ValueError(f"{self.setting(knob)} does nothing without {names} ({why}): set it or unset {self.env_name(knob)}")

    def _set(self, field: str) -> bool:
        """Whether a knob differs from its default (an explicit default is indistinguishable from none)."""
        return getattr(self, field) != type(self).model_fields[field].default

    def setting(self, field: str) -> str:
        """'VLLM_MOE_W2_DELTA_GB=8.0', as a message names a knob's value."""
        value = getattr(self, field)
        return f"{self.env_name(field)}={('1' if value else '0') if isinstance(value, bool) else value}"

    def check_placement(self, device: str) -> None:
        """The rules that depend on where the engine runs (`device` "cpu" or "cuda"); raises ConfigError
        naming the knob and the setting it conflicts with. The plugin calls this before loading weights."""
        if not self.w2:
            return
        if device != "cuda" and self.base_cache_gb > 0 and self.delta_gb != 0:
            raise ConfigError(
                f"{self.setting('base_cache_gb')} with {self.setting('delta_gb')} on {device}: the FP4 pool over the "
                "device expert cache runs on a GPU only (the CPU cache holds base rows); set one of them to 0"
            )
        if device != "cuda" and self.delta_gb == "auto":
            raise ConfigError(
                f"{self.setting('delta_gb')} on {device}: 'auto' sizes a GPU pool from the memory left after the KV cache; give GiB"
            )
        if device != "cuda" and self.prefill_fp8:
            raise ConfigError(f"{self.setting('prefill_fp8')} on {device}: the FP8 prefill is a kernel of sm_90 GPUs; unset it")
        if device != "cuda" and self.cache_miss != "replay":
            raise ConfigError(
                f"{self.setting('cache_miss')} on {device}: the device cache is host memory there, so a miss has no "
                "faster place to run; unset it"
            )

    @classmethod
    def env_name(cls, field: str) -> str:
        return PREFIX if field == "w2" else f"{PREFIX}_{field.upper()}"

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """Environment variable → field, for every knob."""
        return {cls.env_name(name): name for name in cls.model_fields}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Knobs":
        """Read the knobs from an environment; unknown VLLM_MOE_W2_* names are errors."""
        environ = os.environ if environ is None else environ
        by_env = cls.env_names()
        values: dict[str, object] = {}
        for key, raw in environ.items():
            if not key.startswith(PREFIX):
                continue
            if key not in by_env:
                raise ConfigError(f"unknown knob {key}; known: {', '.join(sorted(by_env))}")
            values[by_env[key]] = _parse_env_value(cls, by_env[key], raw)
        return cls.validated(values, source="environment")

    @classmethod
    def validated(cls, values: Mapping[str, object], source: str) -> "Knobs":
        """Knobs from user input (`source` names it in errors): every rule, no-ops included."""
        try:
            knobs = cls(**values)
        except ValidationError as exc:
            err = exc.errors()[0]
            message = str(err["msg"]).removeprefix("Value error, ")
            field = str(err["loc"][0]) if err["loc"] else None
            if field is None:
                raise ConfigError(f"{source}: {message}") from None
            name = cls.env_name(field) if field in cls.model_fields else field
            raise ConfigError(f"{source}: {name}={values.get(field)!r}: {message}") from None
        try:
            knobs.check_effective()
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        return knobs

    def to_env(self) -> dict[str, str]:
        """Every knob as the environment variable the plugin reads."""
        env = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None:
                continue
            env[self.env_name(name)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return env


# Knobs that act only through another one: knob → (the knobs of which one must be set, why). Set
# without them a knob would be a silent no-op, so it is refused. Each chain ends at w2.
NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    **{field: (("w2",), "the 2-bit expert path is off") for field in ("delta_gb", "store_dir", "zero_mode", "prefill_fp8")},
    "fp4_tier": (("delta_gb",), "the FP4 tier is loaded only for the pool"),
    "gate": (("delta_gb",), "the gate promotes experts into the FP4 pool"),
    **{field: (("gate",), "a setting of the confidence gate") for field in ("gate_tau", "gate_tau_file", "gate_fp_max", "gate_promote_max")},
    **{field: (("store_dir",), "it reads the pack files") for field in ("store_threads", "tier_direct", "base_cache_gb")},
    **{field: (("base_cache_gb",), "a setting of the device expert cache and its replay") for field in (
        "base_ram_gb", "replay_mode", "fp_max", "base_miss_tol", "cache_miss")},
    "kpi_secs": (("delta_gb", "base_cache_gb"), "KPI lines come from the FP4 pool and the replay"),
}
# Knobs that may not both be set: (knob, knob) → why.
CONFLICTS: dict[tuple[str, str], str] = {
    ("zero_mode", "store_dir"): "packs are written with VLLM_MOE_W2_ZERO_MODE=auto; unset one of them",
}


def _parse_env_value(cls: type[Knobs], field: str, raw: str) -> object:
    raw = raw.strip()
    annotation = cls.model_fields[field].annotation
    if annotation is bool:
        if raw not in ("0", "1", "true", "false"):
            raise ConfigError(f"{cls.env_name(field)}={raw!r}: expected 0 or 1")
        return raw in ("1", "true")
    return raw


def describe() -> str:
    """A table of every knob for --help."""
    lines = []
    for name, info in Knobs.model_fields.items():
        lines.append(f"  {Knobs.env_name(name):<28} default {info.default!s:<8} {info.description}")
    return "\n".join(lines)
