"""The declarative model list (`config/models.yaml`): schema, loader and start-up checks."""

from moet.config.loader import Located, default_config_path, load_config, preflight, read_api_key
from moet.config.schema import Config, ModelSpec, Nodes, Settings, Swap

__all__ = ["Config", "Located", "ModelSpec", "Nodes", "Settings", "Swap", "default_config_path", "load_config", "preflight", "read_api_key"]
