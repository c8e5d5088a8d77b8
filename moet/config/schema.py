"""The model list's schema: global settings and one entry per served model.

Knobs are not redefined here: a model entry's knob keys (`delta_gb: 8`, `gate: true`) are the
fields of `moet.knobs.Knobs`, collected into `ModelSpec.knobs` and validated by that one definition.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator

from moet.knobs import Knobs

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

NAME_PATTERN = r"^[A-Za-z0-9_-]+$"
ModelName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
# Keys whose values moet itself sets on the vLLM command line or in its environment.
RESERVED_ARGS = ("--model", "--host", "--port", "--api-key", "--served-model-name")
RESERVED_ENV = ("VLLM_API_KEY", "NOTIFY_SOCKET", "MOET_STATUS_FILE")
# vLLM arguments that `nodes` (with `gpus`) decides for a model served by several hosts.
NODES_ARGS = (
    "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--nnodes", "-n", "--node-rank", "-r",
    "--master-addr", "--master-port", "--headless", "--distributed-executor-backend",
)
NODES_ENV = ("VLLM_HOST_IP",)


def _absolute(value: Path) -> Path:
    if not value.is_absolute():
        raise ValueError("must be an absolute path")
    return value


AbsPath = Annotated[Path, AfterValidator(_absolute)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Swap(_Strict):
    """An NVMe swap file for hosts whose pinned expert arenas outgrow RAM."""

    path: AbsPath = Field(Path("/var/swap/moet"), description="Swap file, created once and enabled at boot.")
    size_mib: int = Field(0, ge=0, description="Size in MiB; 0 = no swap file.")


class Settings(_Strict):
    """Host-wide directories; each model gets a subdirectory named after it."""

    state_dir: AbsPath = Field(Path("/var/lib/moet"), description="Per-model state (status files) under <state_dir>/<name>.")
    pack_dir: AbsPath = Field(Path("/var/lib/moet/packs"), description="Pack files (quantization cache) under <pack_dir>/<name>.")
    staging_dir: AbsPath = Field(
        Path("/var/lib/moet/staging"),
        description="Checkpoints staged for serving: the Hugging Face cache (HF_HUB_CACHE) models are resolved from.",
    )
    stop_grace_s: float = Field(30.0, gt=0, le=600, description="Seconds vLLM gets to stop after SIGTERM before SIGKILL.")
    swap: Swap = Swap()


def _yaml_number_as_text(field: str, value: Any) -> Any:
    """YAML reads `gate_tau: 0.6` as a float; text knobs take it as the text the user wrote."""
    text_field = Knobs.model_fields[field].annotation in (str, Optional[str])
    return str(value) if text_field and isinstance(value, (int, float)) and not isinstance(value, bool) else value


class Nodes(_Strict):
    """One model served by several hosts through vLLM's multiprocess backend (`--nnodes`): every host
    declares the same entry but its own `rank`; rank 0, the head, serves the API, the others run vLLM
    headless and join it at `head:port`."""

    count: int = Field(ge=2, le=1024, description="Number of hosts serving the model (at least 2).")
    rank: int = Field(ge=0, description="This host's rank: 0 is the head (the API), 1..count-1 are workers.")
    head: str = Field(min_length=1, description="The head's address as the other hosts reach it (vLLM --master-addr).")
    port: int = Field(29501, ge=1, le=65535, description="Rendezvous port on the head (torch.distributed store, vLLM --master-port).")
    address: str | None = Field(
        None, min_length=1, description="This host's address as the others reach it (VLLM_HOST_IP); unset: vLLM's guess."
    )
    split: Literal["pipeline", "tensor"] = Field(
        "pipeline",
        description="Across hosts: 'pipeline' (layers split by host, tensor parallel over each host's gpus) "
        "or 'tensor' (one tensor-parallel group over every host's gpus).",
    )

    @field_validator("count", mode="before")
    @classmethod
    def _several(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value < 2:
            raise ValueError(f"count {value}: a model on several hosts needs at least 2; for one host remove `nodes`")
        return value

    @model_validator(mode="after")
    def _rank_below_count(self) -> "Nodes":
        if self.rank >= self.count:
            raise ValueError(f"rank {self.rank} must be below count {self.count}: ranks run from 0 (the head) to {self.count - 1}, one per host")
        return self

    @property
    def is_head(self) -> bool:
        return self.rank == 0


class ModelSpec(_Strict):
    """One served model: what to load, where to listen, and its knobs (`w2` defaults to true here, as
    in `moet serve`: a model list serves 2-bit experts unless an entry says `w2: false`)."""

    model: str = Field("default", description="Checkpoint directory, Hugging Face id, or 'default' (the embedded model).")
    host: str = Field(DEFAULT_HOST, description="Listen address; loopback unless exposure is intended.")
    port: int = Field(ge=1, le=65535, description="Listen port; unique across the list.")
    gpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="GPU indices (CUDA_VISIBLE_DEVICES); several imply tensor parallelism. Unset: all visible."
    )
    nodes: Nodes | None = Field(None, description="Serve the model from several hosts (vLLM multi-node); unset: this host alone.")
    env: dict[str, str] = Field({}, description="Extra environment for vLLM (not knobs, not secrets).")
    args: list[str] = Field([], description="Extra vLLM server arguments, appended last.")
    api_key_file: AbsPath | None = Field(None, description="File holding the API key; the unit loads it as credential 'api-key'.")
    knobs: Knobs = Knobs()

    @model_validator(mode="before")
    @classmethod
    def _collect_knobs(cls, data: Any) -> Any:
        """Move flat knob keys (`delta_gb: 8`) into `knobs`, where `Knobs` validates them."""
        if not isinstance(data, dict) or "knobs" in data:
            return data
        knobs = {"w2": True} | {k: _yaml_number_as_text(k, data[k]) for k in Knobs.model_fields if k in data}
        rest = {k: v for k, v in data.items() if k not in knobs}
        return {**rest, "knobs": knobs}

    @field_validator("knobs")
    @classmethod
    def _effective(cls, value: Knobs) -> Knobs:
        value.check_effective()
        return value

    @field_validator("model")
    @classmethod
    def _no_relative_path(cls, value: str) -> str:
        """Units run from / and install-units copies the list to /etc/moet: a relative path would
        name a different directory there."""
        if value.startswith((".", "~")):
            raise ValueError("a checkpoint directory must be an absolute path (or a Hugging Face id, or 'default')")
        return value

    @field_validator("args")
    @classmethod
    def _no_reserved_args(cls, value: list[str], info: ValidationInfo) -> list[str]:
        """Under `nodes` moet derives vLLM's multi-node flags from nodes and gpus: the same flag in
        args would contradict them on one host and not on the others."""
        for arg in value:
            name = arg.split("=", 1)[0]
            if name in RESERVED_ARGS:
                raise ValueError(f"{name} is set by moet (use model/host/port/api_key_file)")
            if info.data.get("nodes") is not None and name in NODES_ARGS:
                raise ValueError(f"{name} is set by moet from nodes and gpus; remove it (nodes.split chooses the layout)")
        return value

    @field_validator("env")
    @classmethod
    def _no_reserved_env(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        for key in value:
            if key.startswith("VLLM_MOE_W2"):
                raise ValueError(f"{key}: set knobs as model keys (e.g. delta_gb: 8), not through env")
            if key in RESERVED_ENV:
                raise ValueError(f"{key} is set by moet (the API key comes from api_key_file or a credential)")
            if info.data.get("nodes") is not None and key in NODES_ENV:
                raise ValueError(f"{key} is set by moet from nodes.address; set nodes.address instead")
        return value

    def ranks_per_node(self) -> int:
        """vLLM ranks this host runs: one per listed GPU, one on a host that lists none (CPU, or one GPU)."""
        return len(self.gpus) if self.gpus else 1


class Config(_Strict):
    """The whole model list."""

    settings: Settings = Settings()
    models: dict[ModelName, ModelSpec]

    @model_validator(mode="before")
    @classmethod
    def _default_stores(cls, data: Any) -> Any:
        """Each 2-bit model caches its quantization in <pack_dir>/<name> unless it names its own
        store_dir, or forces a zero mode (packs are written with zero_mode auto). Set before the knobs
        are validated, so that knobs which read the pack (base_cache_gb, tier_direct) count it."""
        if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
            return data
        settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
        pack_dir = Path(str(settings.get("pack_dir", Settings.model_fields["pack_dir"].default)))
        models = {}
        for name, spec in data["models"].items():
            if isinstance(spec, dict) and "knobs" not in spec and "store_dir" not in spec \
                    and spec.get("w2", True) is True and spec.get("zero_mode", "auto") == "auto":
                spec = {**spec, "store_dir": str(pack_dir / str(name))}
            models[name] = spec
        return {**data, "models": models}

    def model_dirs(self, name: str) -> dict[str, Path]:
        """The directories `moet supervise NAME` owns (state, packs) and shares (staging)."""
        s = self.settings
        return {"state": s.state_dir / name, "packs": s.pack_dir / name, "staging": s.staging_dir}

    def knobs_for(self, name: str) -> Knobs:
        """The model's knobs (the pack store defaults to <pack_dir>/<name>: `_default_stores`)."""
        return self.models[name].knobs
