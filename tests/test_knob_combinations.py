"""Every knob combination either works or is refused at start-up with one line naming both settings.

The walk covers every knob alone and every pair of knobs (each at a non-default value), with the
2-bit path off and on, the entries of config/models.yaml and the NixOS module's own example, on CPU
and GPU (no rule depends on the parallelism). A refused combination must name two knobs (or a knob
and the device). An accepted CPU combination is built as the plugin builds a model's engine state
(moet.vllm.engine, no vLLM) on one and on two tensor-parallel ranks, and every knob set in it must be read there:
nothing is silently ignored. The serving tests at the end run the combinations the issue named
(a store with the FP4 pool; the NixOS example: store, pool, gate and two ranks) in real vLLM.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from moet.config import load_config
from moet.errors import ConfigError
from moet.formats.experts import RoutedExperts
from moet.knobs import NEEDS, Knobs
from moet.quant.stacked import StackedWeight
from moet.vllm.engine import MoetEngine

ROOT = Path(__file__).resolve().parents[1]
PLACEMENTS = [("cpu", 1), ("cpu", 2), ("cuda", 1), ("cuda", 2)]
# Read by the checkpoint reader itself (moet.formats.experts) wherever a checkpoint is streamed.
READ_ELSEWHERE = {"drop_source_pages"}


def non_default(store: Path) -> dict[str, Any]:
    """A value other than the default for every knob."""
    values = {
        "w2": True, "delta_gb": 1.0, "fp4_tier": "planes", "gate": True, "gate_tau": "0.5",
        "gate_tau_file": str(store / "tau"), "gate_fp_max": 2, "gate_promote_max": 3, "store_dir": str(store),
        "store_threads": 2, "base_cache_gb": 0.001, "base_ram_gb": 0.00002, "tier_direct": True, "zero_mode": "sign",
        "replay_mode": "approximate", "fp_max": 2, "base_miss_tol": 1, "cache_miss": "cpu", "kpi_secs": 5.0,
        "drop_source_pages": False, "prefill_fp8": True,
    }
    assert values.keys() == Knobs.model_fields.keys(), "a new knob needs a value here"
    return values


class Tracked(Knobs):
    """Knobs that record which fields are read."""

    reads: ClassVar[set[str]] = set()

    def __getattribute__(self, name: str) -> Any:
        if name in Knobs.model_fields:
            Tracked.reads.add(name)
        return super().__getattribute__(name)


def nix_example() -> dict[str, Any]:
    """The `flash` model of nix/module.nix's example, as the model list would receive it."""
    text = (ROOT / "nix" / "module.nix").read_text()
    line = re.search(r"flash = \{(.*?)\};\n", text).group(1)
    out: dict[str, Any] = {}
    for key, value in re.findall(r"(\w+) = ([^;]+);", line):
        value = value.strip()
        if value.startswith("["):
            out[key] = [int(v) for v in value.strip("[] ").split()]
        elif value in ("true", "false"):
            out[key] = value == "true"
        else:
            out[key] = value.strip('"') if value.startswith('"') else float(value)
    return out


def refusal(values: dict[str, Any], device: str) -> str | None:
    """The one-line start-up error for these knobs here, or None."""
    try:
        Knobs.validated(values, source="environment").check_placement(device)
    except ConfigError as exc:
        return str(exc)
    return None


def serve_cpu(values: dict[str, Any], model_dir: Path, tp: int) -> set[str]:
    """What the plugin builds from its knobs for one model on CPU (moet.vllm.moe, without vLLM); returns
    the knobs it read."""
    knobs = Tracked(**values)
    Tracked.reads = set()
    if not knobs.w2:
        return Tracked.reads
    with RoutedExperts(model_dir) as stream:
        sources = list(stream)
    layers = len({s.key.layer for s in sources})
    experts = len({s.key.expert for s in sources})
    gate = next(s for s in sources if s.key.proj == "gate")
    hidden, inter = gate.shape[1], gate.shape[0] // tp
    engine = MoetEngine(knobs, str(model_dir), tp_size=tp, tp_rank=0)
    for _ in range(layers):
        engine.add_layer()
    tiers = engine.expert_tiers(torch.device("cpu"))
    device = "meta" if tiers is not None and tiers.cache is not None else "cpu"
    w13 = StackedWeight.empty(experts, 2 * inter, hidden, "nv16", engine.tier, device)
    w2 = StackedWeight.empty(experts, hidden, inter, "nv16", engine.tier, device)
    if tiers is None:
        w2.put(0, slice(None), engine.quantize(next(s for s in sources if s.key.proj == "down")))
    elif tiers.cache is None:
        tiers.fill(0, w13, w2)
    engine.fp4_runtime(experts, (w13.tier_nbytes() + w2.tier_nbytes()) // experts, torch.device("cpu"))
    return Tracked.reads


@pytest.fixture(scope="module")
def model_dir(checkpoint) -> Path:
    return checkpoint("qwen3_moe", "nvfp4")


def combinations(store: Path) -> list[dict[str, Any]]:
    """Every knob alone and every pair, as given and with what they need (NEEDS) added."""
    values = non_default(store)
    names = [n for n in values if n != "w2"]
    out: list[dict[str, Any]] = [{}, {"w2": True}]
    for size in (1, 2):
        for combo in itertools.combinations(names, size):
            given = {n: values[n] for n in combo}
            out += [given, {"w2": True, **given}, closed(given, values)]
    return out


def closed(given: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    out, todo = dict(given), list(given)
    while todo:
        needed = NEEDS.get(todo.pop(), ((),))[0]
        if needed and needed[0] not in out:
            out[needed[0]] = values[needed[0]]
            todo.append(needed[0])
    return out


def test_every_knob_combination_is_refused_or_effective(tmp_path: Path, model_dir: Path, single_thread) -> None:
    served = refused = 0
    env_names = {Knobs.env_name(n): n for n in Knobs.model_fields}
    for values in combinations(tmp_path / "packs"):
        for device, tp in PLACEMENTS:
            message = refusal(values, device)
            if message is not None:
                named = {n for env, n in env_names.items() if re.search(rf"\b{env}\b", message)}
                where = re.search(r"GPU|on cpu", message)
                assert "\n" not in message and named & values.keys(), message
                assert len(named) >= 2 or (named and where), f"{values} on {device}×{tp}: {message}"
                refused += 1
            elif device == "cpu":
                reads = serve_cpu(values, model_dir, tp)
                ignored = set(values) - reads - READ_ELSEWHERE
                assert not ignored, f"{values} on cpu×{tp}: {sorted(ignored)} accepted but never read"
                served += 1
    assert served > 200 and refused > 1000, (served, refused)


def test_the_model_list_example_and_the_nix_example_serve(tmp_path: Path, model_dir: Path) -> None:
    """config/models.yaml's entries (the commented frontier model too) and the NixOS module's example,
    through the model list: accepted, with the default pack store, and every knob read."""
    text = (ROOT / "config" / "models.yaml").read_text()
    text = re.sub(r"^  # (\w+:)$", r"  \1", text.replace("\n  #   ", "\n    "), flags=re.M)
    nix = nix_example()
    assert (nix["delta_gb"], nix["gate"], nix["gpus"]) == (8.0, True, [0, 1])
    nix_knobs = "".join(f"    {k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in nix.items() if k not in ("model", "gpus", "port"))
    port = 1 + max(int(p) for p in re.findall(r"port: (\d+)", text))
    text += f"  nix:\n    port: {port}\n    gpus: [0, 1]\n{nix_knobs}"
    text = text.replace("/var/lib/moet", str(tmp_path))
    (tmp_path / "models.yaml").write_text(text)
    config = load_config(tmp_path / "models.yaml").config
    assert set(config.models) == {"default", "flash", "glm", "nix"}
    for name, spec in config.models.items():
        knobs = config.knobs_for(name)
        assert knobs.store_dir == str(tmp_path / "packs" / name)
        tp = len(spec.gpus or [0])
        knobs.check_placement("cpu")
        tp = min(tp, 2)  # the test checkpoint's experts split in two at most (glm's four GPUs: as two)
        ignored = set(Knobs.model_fields) - serve_cpu(dict(knobs), model_dir, tp) - READ_ELSEWHERE
        assert not {k for k in ignored if knobs._set(k)}, f"{name}: {ignored}"


def test_named_refusals() -> None:
    """The combinations the issue names, refused at start-up with one line naming both settings."""
    cases = [
        ({"w2": True, "delta_gb": "auto"}, "cpu", ["VLLM_MOE_W2_DELTA_GB=auto", "on cpu"]),
        ({"delta_gb": 8.0}, "cpu", ["VLLM_MOE_W2_DELTA_GB=8.0", "without VLLM_MOE_W2 "]),
        ({"w2": True, "gate_tau": "0.5"}, "cpu", ["VLLM_MOE_W2_GATE_TAU=0.5", "without VLLM_MOE_W2_GATE "]),
        ({"w2": True, "tier_direct": True}, "cpu", ["VLLM_MOE_W2_TIER_DIRECT=1", "without VLLM_MOE_W2_STORE_DIR"]),
        ({"w2": True, "prefill_fp8": True}, "cpu", ["VLLM_MOE_W2_PREFILL_FP8=1", "on cpu"]),
        ({"w2": True, "store_dir": "/p", "base_cache_gb": 1.0, "delta_gb": 1.0}, "cpu",
         ["VLLM_MOE_W2_BASE_CACHE_GB=1.0", "VLLM_MOE_W2_DELTA_GB=1.0"]),
    ]
    for values, device, words in cases:
        message = refusal(values, device)
        assert message is not None and all(w in message for w in words), (values, message)
    # the device cache runs on a GPU, with the FP4 pool over it too (moet.kernels.cache_slots); no rule
    # depends on the parallelism: every tier works per rank (tests/test_parallel_tiers.py)
    for extra in ({}, {"delta_gb": 1.0}, {"delta_gb": "auto", "gate": True}):
        assert refusal({"w2": True, "store_dir": "/p", "base_cache_gb": 1.0, **extra}, "cuda") is None, extra


def test_a_store_with_the_fp4_pool_holds_the_tier(tmp_path: Path, model_dir: Path) -> None:
    """VLLM_MOE_W2_STORE_DIR with VLLM_MOE_W2_DELTA_GB > 0 wrote a pack without the FP4 tier and then
    filled a missing refinement; now the pack holds the tier and the layer read from it equals the
    layer quantized from the checkpoint, FP4 tier included, on one rank and on each of two."""
    with RoutedExperts(model_dir) as stream:
        sources = list(stream)
    layer = [s for s in sources if s.key.layer == min(s.key.layer for s in sources)]
    experts = len({s.key.expert for s in layer})
    gate = next(s for s in layer if s.key.proj == "gate")
    for tp in (1, 2):
        for rank in range(tp):
            knobs = Knobs(w2=True, delta_gb=1.0, store_dir=str(tmp_path / f"tp{tp}"))
            packed = MoetEngine(knobs, str(model_dir), tp, rank)
            direct = MoetEngine(Knobs(w2=True, delta_gb=1.0), str(model_dir), tp, rank)
            packed.add_layer()
            hidden, inter = gate.shape[1], gate.shape[0] // tp
            stacks = {}
            for name, engine in (("pack", packed), ("direct", direct)):
                w13 = StackedWeight.empty(experts, 2 * inter, hidden, "nv16", "refine")
                w2 = StackedWeight.empty(experts, hidden, inter, "nv16", "refine")
                if name == "pack":
                    engine.expert_tiers(torch.device("cpu")).fill(0, w13, w2)
                else:
                    for src in layer:
                        qw = engine.quantize(src)
                        rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}.get(src.key.proj)
                        (w2 if rows is None else w13).put(src.key.expert, rows or slice(None), qw)
                stacks[name] = (w13, w2)
            for got, want in zip(stacks["pack"], stacks["direct"]):
                assert torch.equal(got.codes, want.codes) and torch.equal(got.refine, want.refine)
                assert torch.equal(got.fp4_planes(), want.fp4_planes()) and got.refine.any()


def _same_answers(got: list[dict], want: list[dict]) -> None:
    """Same tokens and prompt log-probs, decode log-probs within 1e-6 (as tests/test_vllm_tiers.py: runs
    that read the pack may differ from resident ones in the last bit of some decode log-probs)."""
    for a, b in zip(got, want, strict=True):
        assert a["tokens"] == b["tokens"]
        for step_a, step_b in zip(a["logprobs"], b["logprobs"]):
            assert step_a.keys() == step_b.keys() and max(abs(step_a[t] - step_b[t]) for t in step_b) <= 1e-6


@pytest.mark.vllm
def test_store_with_the_fp4_pool_serves_the_fp4_tier(model_dir: Path, tmp_path: Path) -> None:
    """A pack store beside a pool of every expert answers as the same pool without a store: the FP4
    tier comes out of the pack (before: a pack without the tier, and a crash filling it)."""
    from tests.test_vllm_plugin import PROMPTS, run_vllm, start_vllm

    spec = {"model": str(model_dir), "prompts": PROMPTS, "dtype": "float32"}
    pool = {"VLLM_MOE_W2": "1", "VLLM_MOE_W2_DELTA_GB": "1"}
    without_store = start_vllm(spec, **pool)  # beside the stored run, two at a time
    stored = run_vllm(spec, **pool, VLLM_MOE_W2_STORE_DIR=str(tmp_path / "packs"))
    assert (tmp_path / "packs" / "rank0.pack").is_file()
    _same_answers(stored, without_store.result())


@pytest.mark.vllm
def test_the_nix_example_serves_on_two_ranks(model_dir: Path, tmp_path: Path) -> None:
    """The NixOS module's example (a store, as the supervisor sets for every model, delta_gb = 8,
    gate = true, gpus = [ 0 1 ]: two tensor-parallel ranks) serves on CPU, each rank from its own pack,
    and answers as the same knobs without a store (before: refused, tensor parallelism with a store)."""
    from tests.test_vllm_plugin import PROMPTS, run_vllm, start_vllm

    nix = nix_example()
    spec = {"model": str(model_dir), "prompts": PROMPTS, "dtype": "float32", "tp": len(nix["gpus"])}
    knobs = {"VLLM_MOE_W2": "1", "VLLM_MOE_W2_DELTA_GB": str(nix["delta_gb"]), "VLLM_MOE_W2_GATE": "1"}
    without_store = start_vllm(spec, **knobs)  # beside the stored run, two at a time
    stored = run_vllm(spec, **knobs, VLLM_MOE_W2_STORE_DIR=str(tmp_path / "packs"))
    assert sorted(p.name for p in (tmp_path / "packs").glob("*.pack")) == ["rank0.pack", "rank1.pack"]
    _same_answers(stored, without_store.result())
