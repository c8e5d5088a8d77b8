"""Hostile files: safetensors headers, checkpoint indexes and model lists fail only with moet's own
errors, and a header that claims terabytes is refused before anything of that size is allocated.

The generated cases run for seconds here (moet.bench._fuzzing; `moet bench fuzz` runs them longer);
the hand-written ones are the attacks a generator is unlikely to find on its own.
"""

from __future__ import annotations

import json
import resource
import struct
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from moet.bench._fuzzing import ALLOC_LIMIT_BYTES, TARGETS, property_for
from moet.config import load_config
from moet.errors import CheckpointError, ConfigError
from moet.formats.checkpoint import shard_paths
from moet.formats.safetensors_io import SafetensorsFile, read_header

TB = 2**40


@pytest.mark.parametrize("target", list(TARGETS))
def test_generated_inputs_raise_only_moet_errors(target: str, tmp_path: Path) -> None:
    run = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    run(property_for(target, tmp_path))()


def write_safetensors(path: Path, header: dict, payload: bytes = b"", length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + payload)
    return path


@pytest.mark.parametrize(
    "header, length",
    [
        ({"w": {"dtype": "F32", "shape": [2**20, 2**18], "data_offsets": [0, TB]}}, None),  # 1 TiB tensor in a tiny file
        ({"w": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}}, 2**63),  # header length of 8 EiB
        ({"w": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}}, 99 * 2**20),  # 99 MiB header, file of 100 bytes
        ({"w": {"dtype": "U8", "shape": [TB], "data_offsets": [0, 16]}}, None),  # shape and span disagree
    ],
    ids=["tensor-1TiB", "header-8EiB", "header-99MiB", "shape-lies"],
)
def test_lying_header_is_refused_before_allocating(tmp_path: Path, header: dict, length: int | None) -> None:
    path = write_safetensors(tmp_path / "model.safetensors", header, bytes(16), length)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="model.safetensors"):
            SafetensorsFile(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < ALLOC_LIMIT_BYTES
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 64 * 1024  # KiB: no 64 MiB jump either


def test_deeply_nested_header_is_a_checkpoint_error(tmp_path: Path) -> None:
    raw = b"[" * 200_000 + b"]" * 200_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match="deep.safetensors"):
        read_header(path)


@pytest.mark.parametrize(
    "weight_map",
    [{"w": "../outside.safetensors"}, {"w": "/etc/passwd"}, {"w": 7}, {"w": ["a"]}, {"w": "a\0b"}, {"a": "x", "b": 1}],
    ids=["dotdot", "absolute", "int", "list", "nul", "mixed"],
)
def test_index_names_only_shards_inside_the_checkpoint(tmp_path: Path, weight_map: dict) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"")
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="index"):
        shard_paths(root)


HOSTILE_YAML = {
    # a billion laughs: nine levels of ten aliases each expand to 10**9 nodes
    "laughs": "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))
    + "models: {m: {port: 8000, args: *i}}\n",
    "recursive-alias": "models: &m {m: {port: 8000, env: *m}}\n",
    "deep": "models: " + "[" * 50_000 + "]" * 50_000 + "\n",
    "huge-int": "models: {m: {port: 1" + "0" * 5000 + "}}\n",
}


@pytest.mark.parametrize("text", list(HOSTILE_YAML.values()), ids=list(HOSTILE_YAML))
def test_hostile_model_list_is_one_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="models.yaml"):
        load_config(path)


def test_model_list_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_bytes(b"models:\n  m: {port: 8000, host: \"\xff\xfe\"}\n")
    with pytest.raises(ConfigError, match="models.yaml"):
        load_config(path)
