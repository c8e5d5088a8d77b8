"""One model on two "hosts" joined over loopback, the way two machines join: two `moet supervise`
processes, each with its own model list (`nodes.rank` 0 and 1, head 127.0.0.1), each starting its own
vLLM (the head's OpenAI server, the worker's `vllm serve --headless`), one tensor-parallel group of two
ranks across them through vLLM's multiprocess backend (`--nnodes 2`). The answer to an OpenAI request
must be token for token a single-process TP=1 run's; the worker must follow its head's lifetime."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from moet.models import DEFAULT_MODEL_DIR
from moet.status import PHASE_FILE, read_status
from tests.servers import NotifyListener, free_port, group_members, listening, moet, stop
from tests.test_vllm_plugin import run_vllm

pytestmark = pytest.mark.vllm
# The TP=1 run of tests/test_vllm_fp4.py (same spec: run_vllm starts it once per session).
PROMPT = "def main(argv):\n    parser ="
REFERENCE = {"model": str(DEFAULT_MODEL_DIR), "prompts": [PROMPT], "dtype": "float32", "max_tokens": 12}
WATCHDOG_USEC = 2_000_000


def node_list(tmp_path: Path, rank: int, port: int, rendezvous: int) -> Path:
    """The model list of host `rank`: the same entry on both, each host with its own directories."""
    root = tmp_path / f"node{rank}"
    cfg = tmp_path / f"node{rank}.yaml"
    cfg.write_text(
        f"settings:\n  state_dir: {root}/state\n  pack_dir: {root}/packs\n  staging_dir: {root}/staging\n  stop_grace_s: 20\n"
        f"models:\n  moe:\n    model: default\n    port: {port}\n    args: ['--dtype', 'float32', '--max-model-len', '256']\n"
        f"    nodes: {{count: 2, rank: {rank}, head: 127.0.0.1, port: {rendezvous}, address: 127.0.0.1, split: tensor}}\n"
    )
    return cfg


def test_two_nodes_over_loopback_answer_like_one_process(tmp_path: Path) -> None:
    port, rendezvous = free_port(), free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MOE_W2")}
    notify = {rank: NotifyListener(tmp_path / f"notify{rank}.sock") for rank in (0, 1)}
    env = {rank: {**base, "NOTIFY_SOCKET": str(notify[rank].path), "WATCHDOG_USEC": str(WATCHDOG_USEC)} for rank in (0, 1)}
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run_vllm, REFERENCE, VLLM_MOE_W2="1")  # meanwhile, on the same two cores
        # The worker first: it waits for its head, as a worker host booted before the head does.
        worker = moet("supervise", "moe", "--config", str(node_list(tmp_path, 1, port, rendezvous)), env=env[1], log=tmp_path / "worker.log")
        head = moet("supervise", "moe", "--config", str(node_list(tmp_path, 0, port, rendezvous)), env=env[0], log=tmp_path / "head.log")
        try:
            notify[1].first("READY", "1", proc=worker)
            notify[0].first("READY", "1", proc=head)  # after /health and a warm-up completion over both ranks
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            reply = client.completions.create(
                model="moe", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0, extra_body={"return_tokens_as_token_ids": True}
            )
            tokens = [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]
            assert tokens == reference.result()[0]["tokens"], (reply.choices[0].text, (tmp_path / "worker.log").read_text()[-3000:])

            vllm_group = read_status(tmp_path / "node1" / "state" / "moe" / PHASE_FILE)["vllm_pid"]
            worker_pids = [int(member.split()[0]) for member in group_members(vllm_group)]
            assert worker_pids and port not in {p for _, p in listening(worker_pids)}  # headless: the API is the head's alone
            assert notify[1].values("WATCHDOG") and "connected to the head at 127.0.0.1" in notify[1].values("STATUS")[-1]

            # The head stops (as when its unit restarts): the worker's supervisor stops its vLLM and
            # exits 1, so that systemd restarts it to join the head's next vLLM.
            stop(head)
            assert worker.wait(timeout=90) == 1, (tmp_path / "worker.log").read_text()[-3000:]
            assert "the head at 127.0.0.1:" in notify[1].values("STATUS")[-1]
            assert group_members(vllm_group) == []
        finally:
            stop(head)
            stop(worker)
            for listener in notify.values():
                listener.close()
