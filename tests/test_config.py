"""The model list: the example loads, knobs map onto moet.knobs, and every kind of mistake is one
error that names the file, the line and the key, raised before anything starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moet.config import load_config, preflight, read_api_key
from moet.errors import ConfigError
from moet.models import DEFAULT_MODEL_DIR
from moet.supervisor import vllm_command

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "config" / "models.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


def test_example_loads_and_serves_the_embedded_default() -> None:
    located = load_config(EXAMPLE)
    spec = located.config.models["default"]
    assert (spec.model, spec.host, spec.port, spec.knobs.w2) == ("default", "127.0.0.1", 8000, True)
    assert located.config.knobs_for("default").store_dir == "/var/lib/moet/packs/default"
    if (DEFAULT_MODEL_DIR / "config.json").is_file():  # the embedded checkpoint, once it is built
        assert preflight(located, "default") == DEFAULT_MODEL_DIR


def test_knob_keys_are_the_knobs_fields(tmp_path: Path) -> None:
    cfg = write(tmp_path, "models:\n  m:\n    port: 8100\n    delta_gb: 8\n    gate: true\n    gate_tau: 'budget:0.2'\n    store_dir: /srv/p\n")
    knobs = load_config(cfg).config.knobs_for("m")
    assert (knobs.delta_gb, knobs.gate, knobs.gate_tau, knobs.store_dir) == (8.0, True, "budget:0.2", "/srv/p")
    env = knobs.to_env()
    assert env["VLLM_MOE_W2_DELTA_GB"] == "8.0" and env["VLLM_MOE_W2_GATE"] == "1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("models:\n  a:\n    port: 8000\n    bogus: 1\n", ":4: models.a.bogus: unknown key; known: model, host"),
        ("models:\n  a:\n    port: 8000\n    delta_gb: -1\n", ":4: models.a.delta_gb: must be a size in GiB"),
        ("models:\n  a:\n    port: 8000\n    gate: maybe\n", ":4: models.a.gate: "),
        ("models:\n  a:\n    port: 8000\n  b:\n    port: 8000\n", ":5: models.b.port: port 8000 is also used by model 'a'"),
        ("models:\n  a:\n    port: 1\n  a:\n    port: 2\n", ":4: models.a: duplicate key"),
        ("models:\n  bad.name:\n    port: 1\n", ":2: models.bad.name: model names must match"),
        ("models:\n  a:\n    port: [1\n", ":4: bad YAML"),
        ("models:\n  a:\n    host: 127.0.0.1\n", ":2: models.a.port: required key is missing"),
        ("settings:\n  pack_dir: packs\nmodels: {}\n", ":2: settings.pack_dir: must be an absolute path"),
        ("settings:\n  swap:\n    size_gb: 3\nmodels: {}\n", ":3: settings.swap.size_gb: unknown key; known: path, size_mib"),
        ("models:\n  a:\n    port: 1\n    args: ['--api-key', 'k']\n", ":4: models.a.args: --api-key is set by moet"),
        ("models:\n  a:\n    port: 1\n    env:\n      VLLM_MOE_W2_GATE: '1'\n", ":4: models.a.env: VLLM_MOE_W2_GATE: set knobs as model keys"),
        ("- just\n- a list\n", ":1: the model list must be a mapping"),
        ("models:\n  a:\n    port: 1\n    model: ./ckpt\n", ":4: models.a.model: a checkpoint directory must be an absolute path"),
    ],
)
def test_mistakes_name_the_line_and_key(tmp_path: Path, text: str, expected: str) -> None:
    cfg = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert str(info.value).startswith(str(cfg)) and expected in str(info.value), str(info.value)


def test_missing_model_path_is_refused_with_its_line(tmp_path: Path) -> None:
    cfg = write(tmp_path, f"models:\n  a:\n    port: 8101\n\n    model: {tmp_path}/nowhere\n")
    with pytest.raises(ConfigError, match=r":5: models\.a\.model: .*nowhere"):
        preflight(load_config(cfg), "a")


def test_port_in_use_is_refused_with_its_line(tmp_path: Path, checkpoint) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = write(tmp_path, f"models:\n  a:\n    model: {checkpoint('qwen3_moe', 'bf16')}\n    port: {port}\n")
        with pytest.raises(ConfigError, match=rf":4: models\.a\.port: cannot listen on 127\.0\.0\.1:{port} \(in use\)"):
            preflight(load_config(cfg), "a")


def test_unknown_model_name(tmp_path: Path) -> None:
    cfg = write(tmp_path, "models:\n  a:\n    port: 8102\n")
    with pytest.raises(ConfigError, match=r":1: models: no model named 'b' \(declared: a\)"):
        preflight(load_config(cfg), "b")


def test_api_key_goes_to_the_environment_never_argv(tmp_path: Path, checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-file\n")
    cfg = write(tmp_path, f"models:\n  a:\n    model: {checkpoint('qwen3_moe', 'bf16')}\n    port: 8103\n    api_key_file: {key_file}\n")
    located = load_config(cfg)
    spec = located.config.models["a"]
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    assert read_api_key(spec) == "s3cret-file"
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "api-key").write_text("s3cret-credential")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    assert read_api_key(spec) == "s3cret-credential"  # LoadCredential= wins over the file
    dirs = located.config.model_dirs("a")
    argv, env = vllm_command(located, "a", preflight(located, "a"), dirs, read_api_key(spec))
    assert env["VLLM_API_KEY"] == "s3cret-credential"
    assert not any("s3cret" in arg for arg in argv)
    assert env["MOET_STATUS_FILE"] == str(dirs["state"] / "status.json")
    key_file.unlink()
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    with pytest.raises(ConfigError, match=r":5: models\.a\.api_key_file: cannot read"):
        preflight(located, "a")


CLI_MISTAKES = {
    "bad YAML": ("models:\n  a:\n    port: 8104: 1\n", ":3: bad YAML: mapping values are not allowed here"),
    "unknown key": ("models:\n  a:\n    port: 8104\n    colour: red\n", ":4: models.a.colour: unknown key; known: model, host, port"),
    "bad knob": ("models:\n  a:\n    port: 8104\n    gate_tau: 7\n", ":4: models.a.gate_tau: '7' must be in [0, 1]"),
    "duplicate port": ("models:\n  b:\n    port: 8104\n  a:\n    port: 8104\n", ":5: models.a.port: port 8104 is also used by model 'b'"),
    "missing model": ("models:\n  a:\n    port: 8104\n    model: /nonexistent/ckpt\n", ":4: models.a.model: /nonexistent/ckpt: no such checkpoint directory"),
    "port in use": ("models:\n  a:\n    model: {ckpt}\n    port: {busy}\n", ":4: models.a.port: cannot listen on 127.0.0.1:{busy} (in use)"),
}


@pytest.mark.parametrize("case", sorted(CLI_MISTAKES))
def test_supervise_refuses_mistakes_before_starting_anything(tmp_path: Path, checkpoint, case: str) -> None:
    """`moet supervise`: exit 1, one line naming file/line/key, the same text as STATUS=, no vLLM."""
    with socket.socket() as busy, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        text, expected = (t.format(ckpt=checkpoint("qwen3_moe", "bf16"), busy=busy.getsockname()[1]) for t in CLI_MISTAKES[case])
        cfg = write(tmp_path, text + f"settings:\n  state_dir: {tmp_path}/state\n")
        sock.bind(str(tmp_path / "notify.sock"))
        sock.settimeout(5)
        env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
        proc = subprocess.run([sys.executable, "-m", "moet.cli", "supervise", "a", "--config", str(cfg)], env=env, capture_output=True, text=True, timeout=60)
        messages = [sock.recv(4096).decode(), sock.recv(4096).decode()]
    error = proc.stderr.strip().splitlines()[-1].removeprefix("moet: error: ")
    assert proc.returncode == 1 and error.startswith(f"{cfg}{expected}"), proc.stderr
    assert proc.stderr.count(expected) == 1  # one error line, not a log line and an error line
    assert messages == ["STATUS=checking a", f"STATUS=configuration error: {error}"]
    assert not (tmp_path / "state" / "a" / "supervisor.json").exists()  # vLLM was never started


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("models:port8 \n-{}[]'\"#&*!|>a_"))))
def test_any_text_loads_or_fails_with_a_config_error(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    cfg = tmp_path_factory.mktemp("fuzz") / "models.yaml"
    cfg.write_text(text)
    try:
        load_config(cfg)
    except ConfigError as exc:
        assert str(exc).startswith(str(cfg))


def test_readme_documents_every_key() -> None:
    from moet.config import ModelSpec, Settings, Swap

    readme = (REPO / "config" / "README.md").read_text()
    keys = [*Settings.model_fields, *(f"swap.{k}" for k in Swap.model_fields), *(k for k in ModelSpec.model_fields if k != "knobs")]
    assert [k for k in keys if k != "swap" and f"| `{k}` |" not in readme] == []


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2, 70000), st.floats(allow_nan=True), st.text(max_size=12))
_KEYS = st.sampled_from(["model", "host", "port", "gpus", "env", "args", "api_key_file", "w2", "delta_gb", "gate", "gate_tau", "base_cache_gb", "replay_mode", "bogus", "settings", "models"])
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["settings", "models", "extra"]), st.dictionaries(st.text(max_size=6), _VALUES, max_size=3), max_size=3))
def test_any_structure_loads_or_fails_naming_a_line(tmp_path_factory: pytest.TempPathFactory, data: dict) -> None:
    import yaml

    cfg = tmp_path_factory.mktemp("fuzz") / "models.yaml"
    cfg.write_text(yaml.safe_dump(data))
    try:
        load_config(cfg)
    except ConfigError as exc:
        assert str(exc).startswith(f"{cfg}:") and str(exc).split(":", 2)[1].isdigit(), str(exc)
