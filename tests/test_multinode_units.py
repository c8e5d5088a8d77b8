"""A model on several hosts, without starting vLLM: the `nodes:` entry's mistakes, the vLLM flags of a
head and of a worker host, their units (systemd-analyze verify), and the worker's link to its head
over a real socket. tests/test_multinode.py runs the two hosts for real."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moet.config import load_config, preflight
from moet.errors import ConfigError
from moet.models import DEFAULT_MODEL_DIR
from moet.supervisor import HeadLink, multinode_args, vllm_command

NODES = "nodes: {{count: 2, rank: {rank}, head: 10.0.0.1, address: 10.0.0.{host}, split: tensor}}"


def node_list(tmp_path: Path, rank: int, extra: str = "") -> Path:
    """Host `rank`'s model list for a model on two hosts of 4 GPUs each (what each host's /etc/moet holds)."""
    cfg = tmp_path / f"node{rank}.yaml"
    cfg.write_text(
        f"settings:\n  state_dir: {tmp_path}/state\n  pack_dir: {tmp_path}/packs\n  staging_dir: {tmp_path}/staging\n"
        f"models:\n  glm:\n    port: 8400\n    gpus: [0, 1, 2, 3]\n    api_key_file: {tmp_path}/glm.key\n"
        f"    {NODES.format(rank=rank, host=rank + 1)}\n{extra}"
    )
    return cfg


def without(argv: list[str], *options: str) -> list[str]:
    """`argv` less each of `options` and the value after it."""
    out, skip = [], False
    for arg in argv:
        if not skip and arg not in options:
            out.append(arg)
        skip = not skip and arg in options
    return out


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ("{count: 2, rank: 2, head: h}", "models.m.nodes: rank 2 must be below count 2: ranks run from 0 (the head) to 1"),
        ("{count: 1, rank: 0, head: h}", "models.m.nodes.count: count 1: a model on several hosts needs at least 2; for one host remove `nodes`"),
        ("{count: 2, rank: 0}", "models.m.nodes.head: required key is missing"),
        ("{count: 2, rank: 0, head: h, split: data}", "models.m.nodes.split: Input should be 'pipeline' or 'tensor'"),
        ("{count: 2, rank: 0, head: h, ranks: 2}", "models.m.nodes.ranks: unknown key; known: count, rank, head, port, address, split"),
        ("{count: 2, rank: 0, head: h}\n    args: ['--nnodes=3']", "models.m.args: --nnodes is set by moet from nodes and gpus; remove it"),
        ("{count: 2, rank: 0, head: h}\n    args: ['-tp', '8']", "models.m.args: -tp is set by moet from nodes and gpus"),
        ("{count: 2, rank: 0, head: h}\n    env: {VLLM_HOST_IP: 10.0.0.9}", "models.m.env: VLLM_HOST_IP is set by moet from nodes.address; set nodes.address"),
    ],
)
def test_nodes_mistakes_name_the_line_the_key_and_the_fix(tmp_path: Path, nodes: str, expected: str) -> None:
    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"models:\n  m:\n    port: 8400\n    nodes: {nodes}\n")
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert str(info.value).startswith(f"{cfg}:") and expected in str(info.value), str(info.value)


def test_one_host_may_still_pass_its_own_parallel_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  m:\n    port: 8400\n    args: ['--pipeline-parallel-size', '2']\n    env: {VLLM_HOST_IP: 10.0.0.9}\n")
    assert load_config(cfg).config.models["m"].nodes is None


def test_head_and_worker_get_vllms_multinode_flags(tmp_path: Path) -> None:
    """Same model arguments on both hosts; the head runs the OpenAI server (with the key), the worker
    `vllm serve --headless` through moet.headless (no host, port or key); VLLM_HOST_IP from address."""
    (tmp_path / "glm.key").write_text("k\n")
    commands = {}
    for rank in (0, 1):
        located = load_config(node_list(tmp_path, rank))
        commands[rank] = vllm_command(located, "glm", DEFAULT_MODEL_DIR, located.config.model_dirs("glm"), "k" if rank == 0 else None)
    (head, head_env), (worker, worker_env) = commands[0], commands[1]
    flags = ["--distributed-executor-backend", "mp", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "1", "--nnodes", "2"]
    joined = ["--master-addr", "10.0.0.1", "--master-port", "29501"]
    assert head[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"] and worker[1:3] == ["-m", "moet.headless"]
    assert " ".join(flags + ["--node-rank", "0"] + joined) in " ".join(head)
    assert " ".join(flags + ["--node-rank", "1"] + joined) in " ".join(worker) and worker[-1] == "--headless"
    assert {"--host", "--port", "--served-model-name"} & set(worker) == set() and head[head.index("--port") + 1] == "8400"
    assert without(head[3:], "--host", "--port", "--served-model-name", "--node-rank") == without(worker[3:-1], "--node-rank")
    assert (head_env["VLLM_HOST_IP"], worker_env["VLLM_HOST_IP"]) == ("10.0.0.1", "10.0.0.2")
    assert head_env["CUDA_VISIBLE_DEVICES"] == worker_env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert head_env["VLLM_API_KEY"] == "k" and "VLLM_API_KEY" not in worker_env


def test_pipeline_split_is_tensor_inside_a_host_and_stages_across(tmp_path: Path) -> None:
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  m:\n    port: 8400\n    gpus: [0, 1, 2, 3]\n    nodes: {count: 3, rank: 2, head: 10.0.0.1, port: 29600}\n")
    args = multinode_args(load_config(cfg).config.models["m"])
    assert args == [
        "--distributed-executor-backend", "mp", "--tensor-parallel-size", "4", "--pipeline-parallel-size", "3",
        "--nnodes", "3", "--node-rank", "2", "--master-addr", "10.0.0.1", "--master-port", "29600",
    ]


def test_pipeline_split_is_refused_on_vllms_cpu_build(tmp_path: Path) -> None:
    from moet.serving import on_cpu

    if not on_cpu():
        pytest.skip("the refusal is for vLLM's CPU build")
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  m:\n    port: 8400\n    nodes: {count: 2, rank: 0, head: 127.0.0.1}\n")
    located = load_config(cfg)
    with pytest.raises(ConfigError, match=r":4: models\.m\.nodes\.split: pipeline parallelism fails .*; set split: tensor"):
        vllm_command(located, "m", DEFAULT_MODEL_DIR, located.config.model_dirs("m"), None)


def test_a_worker_needs_neither_its_port_nor_the_key(tmp_path: Path) -> None:
    """The worker serves no API: the port may be taken on its host and the key file absent."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for rank in (0, 1):
            cfg = node_list(tmp_path, rank)
            cfg.write_text(cfg.read_text().replace("port: 8400", f"port: {port}"))
        assert preflight(load_config(tmp_path / "node1.yaml"), "glm") == DEFAULT_MODEL_DIR
        with pytest.raises(ConfigError, match=r"models\.glm\.api_key_file: cannot read"):
            preflight(load_config(tmp_path / "node0.yaml"), "glm")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """`moet install-units` on each host of a two-host model, into one root per host."""
    tmp = tmp_path_factory.mktemp("multinode-units")
    roots = {}
    for rank in (0, 1):
        root = tmp / f"root{rank}"
        cmd = [sys.executable, "-m", "moet.cli", "install-units", "--config", str(node_list(tmp, rank)), "--root", str(root)]
        subprocess.run(cmd, check=True, capture_output=True)
        roots[rank] = root
    return roots


def test_head_and_worker_units_verify_and_say_which_host_is_which(installed: dict[int, Path]) -> None:
    for rank, root in installed.items():
        units = root / "etc/systemd/system"
        env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"}
        proc = subprocess.run(["systemd-analyze", "verify", "moet@glm.service", "moet.target"], cwd=units, env=env, capture_output=True, text=True)
        assert (proc.returncode, proc.stdout + proc.stderr) == (0, ""), rank
    head = (installed[0] / "etc/systemd/system/moet@glm.service.d/model.conf").read_text()
    worker = (installed[1] / "etc/systemd/system/moet@glm.service.d/model.conf").read_text()
    assert "Description=moet: glm (default) on 127.0.0.1:8400, head of 2 nodes (rendezvous port 29501)\n" in head
    assert "Description=moet: glm (default) node 1 of 2, head 10.0.0.1:29501\n" in worker
    assert "LoadCredential=api-key:" in head and "LoadCredential" not in worker  # the key file need not exist on a worker


def test_head_link_follows_the_heads_listener() -> None:
    """Refused before the head listens, open while it does, lost once the head's process closes it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    link = HeadLink("127.0.0.1", port)
    assert not link.connect()  # bound, not yet listening: refused
    server.listen()
    assert link.connect() and not link.lost()
    accepted, _ = server.accept()
    assert not link.lost()
    accepted.close()
    server.close()
    assert link.lost()
    link.close()
