"""moet serve throughput on this machine: decode and prompt tokens/s and peak RSS, 2-bit vs a reference.

Each variant is a real `moet serve` on loopback driven by the openai client: prompt tokens/s from
single long prompts with one output token, decode tokens/s from the time of an N-token request
minus that of a 1-token request on the same prompt (ignore_eos, so every run decodes N), peak RSS summed over the server's process tree.
All variants run at once and are timed in turn, round by round: on cores shared with other work
the load changes within seconds, so the ratio of two variants is taken per round (median kept).
`--synthetic` serves a Qwen3-MoE whose BF16 experts are 4-5 GB (random weights, written once under
.cache/): its NVFP4-experts export with 2-bit experts against the BF16 checkpoint on vLLM's own path,
where decode reads expert bytes from memory rather than cache.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

# The synthetic models, (hidden, expert width, experts, top-k, layers): Qwen3-235B-A22B's expert shape (the size
# class moet serves), 4 layers of 32 experts, BF16 experts 4·32·3·4096·1536·2 B = 4.8 GB; Qwen3-30B-A3B's, 7 layers
# of 64, 7·64·3·2048·768·2 B = 4.2 GB (a decode step reads about twice the dense bytes per expert byte).
SYNTHETIC_SHAPES = {"qwen3-235b": (4096, 1536, 32, 8, 4), "qwen3-30b": (2048, 768, 64, 8, 7)}
SYNTHETIC_DEFAULT = "qwen3-235b"
SYNTHETIC = SYNTHETIC_SHAPES[SYNTHETIC_DEFAULT]
SYNTHETIC_DIR = Path(".cache/synthetic-moe")
# After a request a vLLM worker process keeps polling its shared-memory queue for 1 s (shm_broadcast's busy
# loop, sched_yield), a core's worth of CPU: the next variant is timed only after that. (moet serve runs one
# CPU rank without a worker process, moet.serving.server_env; a --vllm-arg may bring one back.)
SETTLE_S = 1.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint served with 2-bit experts (default: the embedded model)")
    parser.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="NAME=DIR[:W2]",
        help="another variant, e.g. bf16=.cache/default-bf16:0 (W2 0 = stock vLLM path); repeatable",
    )
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for the prefill figure")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens decoded per stream")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of one timed request per variant and figure (median kept)")
    parser.add_argument("--synthetic", nargs="?", const=SYNTHETIC_DEFAULT, choices=sorted(SYNTHETIC_SHAPES), metavar="SHAPE",
                        help="serve a synthetic model whose BF16 experts are 4-5 GB (2-bit vs BF16) instead; SHAPE: "
                             f"%(choices)s (default {SYNTHETIC_DEFAULT})")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                        help="passed to every variant's vLLM server (repeat for several; e.g. --vllm-arg=--no-enforce-eager "
                             "to compile the model instead of moet's eager default on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")


class RssSampler(threading.Thread):
    """Resident memory of a process and all its descendants, sampled every `every_s`: the peak,
    and the series (monotonic time, bytes) for benches that check RSS stays flat over a run."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.every_s = every_s
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while not self.stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs if p.is_running())
                self.peak = max(self.peak, rss)
                self.samples.append((time.monotonic(), rss))
            except psutil.Error:
                pass
            self.stop.wait(self.every_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 600) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"moet serve exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"moet serve not healthy after {timeout} s")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class Server:
    """One `moet serve` variant on loopback, booted and warmed up; timed one request at a time by `run`,
    which interleaves the variants so that each round meets them all under the same load."""

    def __init__(self, model: str | None, w2: bool, vllm_args: list[str]) -> None:
        import openai

        port = free_port()
        env = {**os.environ, "VLLM_MOE_W2": "1" if w2 else "0"}
        cmd = [sys.executable, "-m", "moet.cli", "serve", *([model] if model else []), "--port", str(port), "--name", "bench",
               *(["--", *vllm_args] if vllm_args else [])]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.sampler = RssSampler(self.proc.pid)
        self.sampler.start()
        try:
            self.boot_s = wait_healthy(self.proc, port)
            self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            self.client.completions.create(model="bench", prompt=list(range(10, 26)), max_tokens=4)  # warm-up
        except BaseException:
            self.stop()
            raise

    def prefill(self, prompt: list[int]) -> float:
        """Prompt tokens/s of one request with one output token."""
        start = time.perf_counter()
        self.client.completions.create(model="bench", prompt=prompt, max_tokens=1, temperature=0)
        return len(prompt) / (time.perf_counter() - start)

    def decode(self, prompt: str, tokens: int) -> float:
        """Decode tokens/s: an N-token request minus a 1-token one on the same prompt."""
        request = {"model": "bench", "prompt": prompt, "temperature": 0, "extra_body": {"ignore_eos": True}}
        start = time.perf_counter()
        self.client.completions.create(max_tokens=1, **request)
        first = time.perf_counter() - start
        start = time.perf_counter()
        full = self.client.completions.create(max_tokens=tokens, **request)
        elapsed = time.perf_counter() - start
        return (full.usage.completion_tokens - 1) / max(elapsed - first, 1e-9)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.sampler.stop.set()


def measure(variants: dict[str, tuple[str | None, bool]], args: argparse.Namespace) -> dict[str, Any]:
    """Boot every variant, then `repeats` rounds of one prefill per variant and one decode per variant
    (an idle vLLM server takes < 1% of a core; each request SETTLE_S after the one before): per
    variant the medians, per round the ratios of the
    first variant to each other one and the 1-minute load average, and the medians of those ratios."""
    servers: dict[str, Server] = {}
    try:
        for name, (model, w2) in variants.items():
            servers[name] = Server(model, w2, args.vllm_arg)
        prompt = list(range(10, 10 + args.prompt_tokens))
        rounds = []
        def settled(fn: Any) -> float:
            time.sleep(SETTLE_S)
            return fn()

        for i in range(args.repeats):
            prefill = {name: settled(lambda: s.prefill([t + i for t in prompt])) for name, s in servers.items()}
            decode = {name: settled(lambda: s.decode(f"def function_{i}(", args.decode_tokens)) for name, s in servers.items()}
            rounds.append({"load_average": round(os.getloadavg()[0], 2), "prompt_tokens_per_s": prefill, "decode_tokens_per_s": decode})
            print(f"round {i}: load {rounds[-1]['load_average']}  prompt "
                  + "  ".join(f"{n} {v:.1f}" for n, v in prefill.items()) + "  decode "
                  + "  ".join(f"{n} {v:.2f}" for n, v in decode.items()), flush=True)
        first = next(iter(servers))
        results: dict[str, Any] = {"variants": {}, "rounds": rounds, "ratios": {}}
        for name, s in servers.items():
            results["variants"][name] = {
                "model": variants[name][0] or "embedded default", "w2": variants[name][1], "boot_s": round(s.boot_s, 1),
                "prompt_tokens_per_s": round(_median([r["prompt_tokens_per_s"][name] for r in rounds]), 1),
                "decode_tokens_per_s": round(_median([r["decode_tokens_per_s"][name] for r in rounds]), 2),
                "peak_rss_mib": round(s.sampler.peak / 2**20),
            }
            if name != first:
                results["ratios"][f"{first}/{name}"] = {
                    figure: round(_median([r[figure][first] / r[figure][name] for r in rounds]), 2)
                    for figure in ("prompt_tokens_per_s", "decode_tokens_per_s")
                }
        return results
    finally:
        for s in servers.values():
            s.stop()


def synthetic_checkpoints(shape: str, root: Path = SYNTHETIC_DIR) -> tuple[Path, Path]:
    """(NVFP4-experts dir, BF16 dir) of synthetic model `shape`, written once: random N(0, 1/fan_in) weights,
    one safetensors shard per layer, the embedded model's tokenizer."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from moet.formats.export import export_nvfp4

    bf16, nvfp4 = root / shape / "bf16", root / shape / "nvfp4-experts"
    hidden, inter, experts, top_k, layers = SYNTHETIC_SHAPES[shape]
    if not bf16.exists():
        default = Path(__file__).resolve().parents[1] / "models" / "default"
        config = json.loads((default / "config.json").read_text())
        config.pop("quantization_config", None)
        heads, head_dim, kv_heads = 16, 128, 4
        config.update(hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter, num_local_experts=experts,
                      num_experts_per_tok=top_k, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim)
        vocab = config["vocab_size"]
        tmp = bf16.with_name(bf16.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        gen = torch.Generator().manual_seed(0)

        def linear(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)

        weight_map: dict[str, str] = {}

        def write(name: str, tensors: dict[str, torch.Tensor]) -> None:
            save_file(tensors, tmp / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))

        write("model-embed.safetensors", {"model.embed_tokens.weight": linear(vocab, hidden) * hidden**0.5,
                                          "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                                          "lm_head.weight": linear(vocab, hidden)})
        for i in range(layers):
            pre = f"model.layers.{i}"
            shard = {f"{pre}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                     f"{pre}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                     f"{pre}.self_attn.q_proj.weight": linear(heads * head_dim, hidden),
                     f"{pre}.self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden),
                     f"{pre}.self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
                     f"{pre}.self_attn.o_proj.weight": linear(hidden, heads * head_dim),
                     f"{pre}.self_attn.q_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
                     f"{pre}.self_attn.k_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
                     f"{pre}.mlp.gate.weight": linear(experts, hidden)}
            for e in range(experts):
                shard[f"{pre}.mlp.experts.{e}.gate_proj.weight"] = linear(inter, hidden)
                shard[f"{pre}.mlp.experts.{e}.up_proj.weight"] = linear(inter, hidden)
                shard[f"{pre}.mlp.experts.{e}.down_proj.weight"] = linear(hidden, inter)
            write(f"model-layer{i:02d}.safetensors", shard)
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(default / name, tmp / name)
        tmp.rename(bf16)
    if not nvfp4.exists():
        export_nvfp4(bf16, nvfp4, experts_only=True)
    return nvfp4, bf16


def run(args: argparse.Namespace) -> int:
    from moet.bench._record import write_results

    if args.synthetic:
        nvfp4, bf16 = synthetic_checkpoints(args.synthetic)
        args.model = str(nvfp4)
        args.reference = [f"bf16={bf16}:0", *args.reference]
    variants: dict[str, tuple[str | None, bool]] = {"2bit": (args.model, True)}
    for spec in args.reference:
        name, _, rest = spec.partition("=")
        path, _, w2 = rest.partition(":")
        variants[name] = (path, w2 == "1")
    results = measure(variants, args)
    for name, figures in results["variants"].items():
        print(f"{name:>8}: {figures}", flush=True)
    for pair, ratio in results["ratios"].items():
        print(f"{pair:>8}: median of the rounds' ratios {ratio}", flush=True)
    write_results(
        "serve",
        {"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens, "repeats": args.repeats,
         "vllm_args": args.vllm_arg,
         "synthetic": {"shape": args.synthetic, **dict(zip(("hidden", "inter", "experts", "top_k", "layers"), SYNTHETIC_SHAPES[args.synthetic]))}
         if args.synthetic else None,
         **results},
        args.out,
    )
    return 0
