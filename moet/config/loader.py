"""Read the model list and check it before anything starts: every error names the key and its line.

PyYAML's constructed data forgets where values came from, so the document is composed first and
the node marks are kept as a key-path → line table that the schema's errors are mapped through.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from moet.config.schema import NAME_PATTERN, Config, ModelSpec, Nodes, Settings, Swap
from moet.errors import ConfigError, MoetError
from moet.knobs import Knobs
from moet.models import resolve_model

Key = tuple[str | int, ...]
# Where `moet supervise` and `moet status` look when --config is not given.
DEFAULT_CONFIG = Path("/etc/moet/models.yaml")
CONFIG_ENV = "MOET_CONFIG"
MAX_KEYS = 10_000


def default_config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV, DEFAULT_CONFIG))


class Located:
    """A validated model list plus the line of every key, for errors found after validation."""

    def __init__(self, config: Config, source: Path, lines: dict[Key, int]) -> None:
        self.config = config
        self.source = source
        self.lines = lines

    def where(self, *key: str | int) -> str:
        """'file:line: a.b.c' for the deepest key of `key` that the file spells out."""
        for end in range(len(key), -1, -1):
            if key[:end] in self.lines:
                return f"{self.source}:{self.lines[key[:end]]}: {'.'.join(map(str, key))}"
        return f"{self.source}: {'.'.join(map(str, key))}"

    def error(self, key: Key, message: str) -> ConfigError:
        return ConfigError(f"{self.where(*key)}: {message}")


def load_config(path: Path | None = None) -> Located:
    """Parse and validate the model list; raises ConfigError naming the file, line and key."""
    path = Path(path or default_config_path())
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the model list ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save the model list as UTF-8") from None
    data, lines = _compose(text, path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: the model list must be a mapping with a `models:` key")
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        located = Located(Config.model_construct(), path, lines)
        raise _explain(exc, located) from None
    located = Located(config, path, lines)
    _check_ports(located)
    return located


def _compose(text: str, path: Path) -> tuple[Any, dict[Key, int]]:
    lines: dict[Key, int] = {(): 1}
    try:
        loader = yaml.SafeLoader(text)  # already reads: refuses control characters
        try:
            node = loader.get_single_node()
            if node is not None:
                # Before constructing: aliases make a small file a huge (or endless) tree for the
                # schema to walk, and a model list needs neither thousands of keys nor cycles.
                _walk(node, (), lines, path, set())
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = f"{mark.line + 1}" if mark else "?"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}:{line}: bad YAML: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: bad YAML: nested too deeply") from None
    except ValueError as exc:  # a scalar PyYAML cannot convert, e.g. an integer of 5,000 digits
        raise ConfigError(f"{path}: bad YAML: {exc}") from None
    return data, lines


def _walk(node: yaml.Node, key: Key, lines: dict[Key, int], path: Path, parents: set[int]) -> None:
    """Record the line of every key path; refuse cycles (an alias inside its own anchor) and
    documents that expand to more than MAX_KEYS key paths (alias bombs)."""
    if id(node) in parents:
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: {'.'.join(map(str, key))}: an alias refers to its own anchor")
    if len(lines) > MAX_KEYS:
        raise ConfigError(f"{path}: more than {MAX_KEYS} keys and items (with aliases expanded); a model list is far smaller")
    parents.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = key + (str(key_node.value),)
            if child in lines:
                raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: {'.'.join(map(str, child))}: duplicate key")
            lines[child] = key_node.start_mark.line + 1
            _walk(value_node, child, lines, path, parents)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[key + (index,)] = item.start_mark.line + 1
            _walk(item, key + (index,), lines, path, parents)
    parents.discard(id(node))


def _known_keys(key: Key) -> list[str]:
    if not key:
        return list(Config.model_fields)
    if key[0] == "settings":
        return list(Swap.model_fields if key[1:2] == ("swap",) else Settings.model_fields)
    if key[2:3] == ("nodes",):
        return list(Nodes.model_fields)
    return [k for k in ModelSpec.model_fields if k != "knobs"] + list(Knobs.model_fields)


def _explain(exc: ValidationError, located: Located) -> ConfigError:
    """The first schema error as 'file:line: key: message' (knob keys keep their flat YAML name)."""
    err = exc.errors()[0]
    key: Key = tuple(part for part in err["loc"] if part != "knobs")
    message = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        message = f"unknown key; known: {', '.join(_known_keys(key[:-1]))}"
    elif err["type"] == "missing":
        message = "required key is missing"
    elif key[-1:] == ("[key]",):
        key, message = key[:-1], f"model names must match {NAME_PATTERN}"
    return located.error(key, message)


def _check_ports(located: Located) -> None:
    seen: dict[int, str] = {}
    for name, spec in located.config.models.items():
        if spec.port in seen:
            raise located.error(("models", name, "port"), f"port {spec.port} is also used by model {seen[spec.port]!r}")
        seen[spec.port] = name


def preflight(located: Located, name: str) -> Path:
    """Everything `moet supervise NAME` can check before starting vLLM; returns the checkpoint dir."""
    config = located.config
    if name not in config.models:
        known = ", ".join(sorted(config.models)) or "none"
        raise located.error(("models",), f"no model named {name!r} (declared: {known})")
    spec = config.models[name]
    model_dir = _model_dir(located, name, spec)
    if spec.nodes is not None and not spec.nodes.is_head:
        return model_dir  # a worker host of a multi-node model: no API, so no port and no key here
    try:
        read_api_key(spec)
    except OSError as exc:
        raise located.error(("models", name, "api_key_file"), f"cannot read {exc.filename} ({exc.strerror})") from None
    _check_port_free(located, name, spec)
    return model_dir


def _model_dir(located: Located, name: str, spec: ModelSpec) -> Path:
    try:
        model_dir = resolve_model(None if spec.model == "default" else spec.model)
    except MoetError as exc:
        raise located.error(("models", name, "model"), str(exc)) from None
    if not (model_dir / "config.json").is_file():
        raise located.error(("models", name, "model"), f"{model_dir}: no checkpoint here (config.json missing)")
    return model_dir


def _check_port_free(located: Located, name: str, spec: ModelSpec) -> None:
    family = socket.AF_INET6 if ":" in spec.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((spec.host, spec.port))
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise located.error(("models", name, "port"), f"cannot listen on {spec.host}:{spec.port} ({why})") from None


def read_api_key(spec: ModelSpec) -> str | None:
    """The API key: the systemd credential `api-key` (LoadCredential=) if the unit passed one, else
    the model's api_key_file, else none. Raises OSError when a named file cannot be read."""
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if creds and (Path(creds) / "api-key").is_file():
        source: Path | None = Path(creds) / "api-key"
    else:
        source = spec.api_key_file
    if source is None:
        return None
    key = source.read_text().strip()
    if not key:
        raise OSError(errno.EINVAL, "the key file is empty", str(source))
    return key
