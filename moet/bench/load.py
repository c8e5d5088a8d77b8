"""moet serve under concurrent load: throughput, latency, errors by kind and RSS over time.

A real `moet serve` on loopback is driven by the official openai client (AsyncOpenAI, no retries)
at each concurrency level for a bounded time: every worker sends requests back to back, half of
them streamed, prompts of mixed lengths, until the level's time is up; then the requests in flight
finish (or time out, which counts as an error). What a server holding a large model must show:
no failed request up to the concurrency it is sized for, only clean refusals (429/503) beyond it,
and a resident set that stops growing once warm. vLLM's own limits (e.g. `--max-num-seqs`) are
passed after `--`; vLLM queues requests beyond them rather than refusing, so overload shows as
latency, not as errors: the JSON records which one happened.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moet.bench.serve import RssSampler, free_port, wait_healthy

MODEL_NAME = "load"
# Python source words, the embedded model's training domain: prompts of mixed lengths are cut from it.
WORDS = ("def return self import class for in if else while with as yield lambda None True False "
         "try except raise print range len list dict str int value result data path name").split()
PROMPT_WORDS = (4, 32, 128, 384)
REFUSALS = {429, 503}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--levels", default="1,4,16,64", help="concurrency levels, comma-separated (default 1,4,16,64)")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of new requests per level (default 40)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (default 16)")
    parser.add_argument("--timeout", type=float, default=900.0, help="client timeout per request in seconds (default 900)")
    parser.add_argument("--sized-for", type=int, default=16, help="concurrency that must see zero failures (default 16)")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    parser.epilog = "Arguments after `--` go to vLLM, e.g. `moet bench load -- --max-num-seqs 16`."


@dataclass
class Level:
    """What one concurrency level saw."""

    concurrency: int
    latencies: list[float] = field(default_factory=list)
    first_tokens: list[float] = field(default_factory=list)  # streamed requests: time to first token
    tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # every failure by kind, refusals included
    refused: int = 0  # clean refusals (429/503): the server saying it is full
    started: float = 0.0
    ended: float = 0.0
    load_average: float = 0.0  # the machine's 1-minute load when the level ended: the box is shared

    def summary(self) -> dict[str, Any]:
        wall = self.ended - self.started
        done = len(self.latencies)
        return {
            "concurrency": self.concurrency,
            "wall_s": round(wall, 2),
            "completed": done,
            "failed": sum(self.errors.values()) - self.refused,
            "refused": self.refused,
            "errors": self.errors,
            "requests_per_s": round(done / wall, 3),
            "tokens_per_s": round(self.tokens / wall, 2),
            "latency_p50_s": _percentile(self.latencies, 50),
            "latency_p99_s": _percentile(self.latencies, 99),
            "ttft_p50_s": _percentile(self.first_tokens, 50),
            "ttft_p99_s": _percentile(self.first_tokens, 99),
            "load_average_1m": round(self.load_average, 1),
        }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))], 3)


def _error_kind(exc: Exception) -> str:
    """'ClassName STATUS' for HTTP errors, the class name for everything else (timeouts, resets)."""
    status = getattr(exc, "status_code", None)
    return f"{type(exc).__name__} {status}" if status is not None else type(exc).__name__


async def _one(client: Any, rng: random.Random, level: Level, max_tokens: int) -> None:
    """One request (streamed or not, a prompt of random length), its outcome added to `level`."""
    words = rng.choice(PROMPT_WORDS)
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    stream = rng.random() < 0.5
    request = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
               "extra_body": {"ignore_eos": True}}
    start = time.perf_counter()
    try:
        if stream:
            tokens, first = 0, None
            response = await client.completions.create(stream=True, stream_options={"include_usage": True}, **request)
            async for chunk in response:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - start
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            if first is not None:
                level.first_tokens.append(first)
        else:
            tokens = (await client.completions.create(**request)).usage.completion_tokens
    except Exception as exc:  # every failure is data: counted by kind and status
        kind = _error_kind(exc)
        level.errors[kind] = level.errors.get(kind, 0) + 1
        level.refused += getattr(exc, "status_code", None) in REFUSALS
        return
    level.latencies.append(time.perf_counter() - start)
    level.tokens += tokens


async def _drive(port: int, concurrency: int, args: argparse.Namespace, seed: int) -> Level:
    """`concurrency` workers send requests back to back until `args.duration` is over, then drain."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=args.timeout)
    level = Level(concurrency)
    deadline = time.monotonic() + args.duration

    async def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < deadline:
            await _one(client, rng, level, args.max_tokens)

    level.started = time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    level.ended = time.monotonic()
    level.load_average = os.getloadavg()[0]
    await client.close()
    return level


def rss_growth(samples: list[tuple[float, int]], start: float, end: float = float("inf")) -> dict[str, float]:
    """Resident set between `start` and `end`: its median over the first and the last quarter of
    that span, and the difference, in MiB. A leak shows as a last quarter above the first at a
    constant load; a step when concurrency rises is buffers for the larger batch."""
    warm = [rss for at, rss in samples if start <= at <= end]
    quarter = max(1, len(warm) // 4)
    first, last = statistics.median(warm[:quarter]), statistics.median(warm[-quarter:])
    return {"first_quarter_mib": round(first / 2**20, 1), "last_quarter_mib": round(last / 2**20, 1),
            "growth_mib": round((last - first) / 2**20, 1), "peak_mib": round(max(warm) / 2**20, 1)}


def plot(path: Path, samples: list[tuple[float, int]], t0: float, levels: list[Level]) -> None:
    """RSS over time with the levels marked, and latency/throughput per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), constrained_layout=True)
    top.plot([at - t0 for at, _ in samples], [rss / 2**20 for _, rss in samples], lw=1, color="tab:blue")
    for level in levels:
        top.axvspan(level.started - t0, level.ended - t0, alpha=0.12, color="tab:orange")
        top.text(level.started - t0, top.get_ylim()[0], f" c={level.concurrency}", va="bottom", fontsize=8)
    top.set(xlabel="seconds since server start", ylabel="server RSS, MiB (process tree)", title="moet serve under load: resident memory")
    names = [str(level.concurrency) for level in levels]
    summaries = [level.summary() for level in levels]
    x = range(len(levels))
    bottom.bar([i - 0.2 for i in x], [s["latency_p50_s"] or 0 for s in summaries], 0.4, label="p50 latency (s)")
    bottom.bar([i + 0.2 for i in x], [s["latency_p99_s"] or 0 for s in summaries], 0.4, label="p99 latency (s)")
    bottom.set(xticks=list(x), xticklabels=names, xlabel="concurrency", ylabel="seconds")
    rate = bottom.twinx()
    rate.plot(list(x), [s["tokens_per_s"] for s in summaries], "ko-", label="tokens/s")
    rate.set_ylabel("generated tokens/s")
    for i, s in enumerate(summaries):
        bottom.annotate(f"{s['completed']} ok, {s['failed']} failed, {s['refused']} refused", (i, 0), fontsize=7,
                        ha="center", va="bottom", xytext=(0, 2), textcoords="offset points")
    bottom.legend(loc="upper left", fontsize=8)
    rate.legend(loc="upper right", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from moet.bench._record import write_results

    levels = [int(n) for n in args.levels.split(",")]
    vllm_args = list(getattr(args, "passthrough", []))
    port = free_port()
    cmd = [sys.executable, "-m", "moet.cli", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--name", MODEL_NAME, *(["--", *vllm_args] if vllm_args else [])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MOE_W2")}  # 2-bit experts, as moet serve defaults
    log = Path(tempfile.mkstemp(prefix="moet-load-", suffix=".log")[1])
    print(f"load: server output in {log}", flush=True)
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    sampler = RssSampler(proc.pid, every_s=0.5)
    sampler.start()
    results: list[Level] = []
    try:
        boot_s = wait_healthy(proc, port)
        print(f"load: server healthy after {boot_s:.0f} s; levels {levels}, {args.duration:g} s each", flush=True)
        for seed, concurrency in enumerate(levels):
            level = asyncio.run(_drive(port, concurrency, args, seed))
            results.append(level)
            print(f"load: {level.summary()}", flush=True)
        alive = proc.poll() is None
    finally:
        sampler.stop.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    summaries = [{**level.summary(), "rss": rss_growth(sampler.samples, level.started, level.ended)} for level in results]
    warm_from = results[0].ended  # the first level warms the server up
    sized = [s for s in summaries if s["concurrency"] <= args.sized_for]
    beyond = [s for s in summaries if s["concurrency"] > args.sized_for]
    verdict = {
        "failed_up_to_sized_for": sum(s["failed"] + s["refused"] for s in sized),
        "failed_beyond": sum(s["failed"] for s in beyond),
        "refused_beyond": sum(s["refused"] for s in beyond),
        "overload_behaviour": "refused" if any(s["refused"] for s in beyond) else "queued (no refusals; latency grows)",
        "server_alive_after": alive,
        "rss_after_warmup": rss_growth(sampler.samples, warm_from),
    }
    print(f"load: {verdict}", flush=True)
    path = write_results("load", {
        "model": args.model or "embedded default", "vllm_args": vllm_args, "duration_s": args.duration,
        "max_tokens": args.max_tokens, "prompt_words": list(PROMPT_WORDS), "streamed_fraction": 0.5,
        "sized_for": args.sized_for, "boot_s": round(boot_s, 1), "levels": summaries, "verdict": verdict,
        "rss_mib": [[round(at - t0, 1), round(rss / 2**20, 1)] for at, rss in sampler.samples],
    }, args.out)
    plot(path.with_suffix(".png"), sampler.samples, t0, results)
    print(f"moet bench: wrote {path.with_suffix('.png')}")
    ok = verdict["failed_up_to_sized_for"] == 0 and verdict["failed_beyond"] == 0 and alive
    return 0 if ok else 1
