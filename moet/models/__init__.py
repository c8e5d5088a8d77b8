"""The small MoE model embedded in the package (moet/models/default; see README.md here), and which
checkpoint directory a model name means."""

from __future__ import annotations

from pathlib import Path

from moet.errors import ConfigError

DEFAULT_MODEL_DIR = Path(__file__).parent / "default"


def resolve_model(model: str | None) -> Path:
    """A local checkpoint directory: the embedded default, a path, or a cached Hugging Face snapshot."""
    if model is None:
        return DEFAULT_MODEL_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path}: no config.json; point MODEL at a Hugging Face checkpoint directory")
        return path.resolve()
    if "/" in model and not model.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(model, local_files_only=True))
        except LocalEntryNotFoundError:
            raise ConfigError(
                f"{model}: not a directory and not in the local Hugging Face cache; download it first "
                f"(huggingface-cli download {model}) or pass a checkpoint directory"
            ) from None
    raise ConfigError(f"{model}: no such checkpoint directory")
