"""Whole-model decode and prefill on the GPU through the plugin's MoE path (a stand-in for vLLM).

Why a stand-in: vLLM is not installed on the H200 this project borrows and cannot be carried there (its
CUDA wheel and dependencies are far over the 64 MiB a device call may carry, and the machine has no
network). So the model classes are transformers' own — Qwen3-MoE for the embedded model; DeepSeek-V3,
the class DeepSeek-V4-Flash and Kimi-K2 use, in their real geometries truncated to a few layers with
random weights — and every routed-experts module is replaced by `MoetExperts`, which runs the body of
MoetMoEMethod.apply (moet.vllm.moe_op.apply_moe) over the layer's one GPU layout
(moet.kernels.layout.gpu_layer) with the engine's own FP4 runtime (moet.vllm.gate_runtime: pool,
VRAM slots, gate). A decode step (transformers' StaticCache, one token per sequence) is captured in
one CUDA graph per variant and batch and replayed; after each step the runtime's `after_logits` runs as
the plugin's step hook runs it (pool commit between steps; the gate re-runs an unsure step by replaying
the same graph). With `--compile` the step is first compiled by torch.compile (inductor; the MoE is one
opaque op), as vLLM compiles before capturing its graphs. Prefill runs eagerly.

Variants: bf16 (the experts' FP4 values in bf16, torch._grouped_mm), base (2-bit), pool25 / pool100
(an FP4 pool of 25% / all experts, filled by routing heat), gate25 (pool25 + the confidence gate at a
budget of 25% of steps), cache50 (the device expert cache holding half of the experts in the kernels'
layout over a pinned host store of the base: each step replayed until no expert misses, as the
plugin's replay driver runs it; the prompt is prefilled from resident experts, since one pass must
hold every expert it routes to). `--check` (embedded model): the GPU path's prompt log-probs and greedy tokens
against a float64 forward over the same 2-bit experts, a pool holding every expert against the
FP4 copies placed directly (bit for bit), and decode through the device cache against resident experts
(bit for bit).

    moet bench e2e --models embedded,deepseek-v4-flash,kimi-k2 --check
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

# Frontier geometries (hidden, expert width, routed experts, top-k, MLA heads, q_lora_rank, routing groups
# (n_group, topk_group), MoE layers of the full model). DeepSeek-V4-Flash's layer count is derived from its
# 159B parameters at 6.4B routed-expert parameters per layer (assumption: 24 MoE layers); Kimi-K2 has 61.
FRONTIER = {
    "deepseek-v4-flash": dict(hidden=4096, inter=2048, experts=256, top_k=6, heads=32, q_lora=1024, groups=(8, 4),
                              full_layers=24, vocab=129280),
    "kimi-k2": dict(hidden=7168, inter=2048, experts=384, top_k=8, heads=64, q_lora=1536, groups=(1, 1),
                    full_layers=61, vocab=163840),
}
VARIANTS = ("bf16", "base", "pool25", "pool100", "gate25", "cache50")
ORIGINAL_TOK_S = 161.0  # the original vLLM-Moet: DeepSeek-V4-Flash, one RTX PRO 6000, single stream, with MTP (issue 12)
ORIGINAL_BW_TBS = 1.8  # RTX PRO 6000 memory bandwidth
H200_TBS = 4.3  # measured copy bandwidth of the H200 here (../shared/KERNEL_NOTES.md: 4.2-4.4 TB/s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="embedded,deepseek-v4-flash,kimi-k2",
                        help="embedded and/or frontier geometries: %(default)s")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="subset of %(default)s")
    parser.add_argument("--batches", default="1,4,16", help="decode batch sizes")
    parser.add_argument("--prefill", type=int, default=2048, help="prefill tokens (one sequence; 0 = skip)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per variant and batch")
    parser.add_argument("--warmup", type=int, default=24, help="decode steps before timing (the pool fills by heat)")
    parser.add_argument("--layers", type=int, default=0, help="frontier layers (0: as many as have their bf16 experts fit in half the GPU's free memory, at least 2, at most what fits)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step before capturing it")
    parser.add_argument("--check", action="store_true", help="correctness checks on the embedded model (GPU vs float64)")
    parser.add_argument("--out-dir", type=Path, default=None, help="results directory (default bench/results)")


def run(args: argparse.Namespace) -> int:
    import torch

    from moet.bench._record import write_results

    if not torch.cuda.is_available():
        print("moet bench e2e: needs a CUDA GPU (the CPU serving path is measured by `moet bench serve`)")
        return 2
    from moet.kernels import cuda

    if not cuda.available():
        print("moet bench e2e: the CUDA decode cubin does not load here; build it with `python scripts/build_kernels.py`")
        return 2
    names = args.models.split(",")
    free, _ = torch.cuda.mem_get_info()  # another process's memory is not ours to fill
    try:  # every model's size is checked before the first one is built
        layers = {n: frontier_layers(n, free, args.layers)
                  for n in names if n != "embedded"}
    except ValueError as err:
        print(f"moet bench e2e: {err}")
        return 2
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "free_bytes": free, "compile": args.compile,
                               "models": {}}
    with_store = "cache50" in args.variants.split(",") or args.check
    for name in names:
        model = embedded_model() if name == "embedded" else frontier_model(name, layers[name], with_store)
        results["models"][name] = bench_model(model, args)
        if name == "embedded" and args.check:
            results["checks"] = check_embedded(model, args)
        del model
        torch.cuda.empty_cache()
    results["summary"] = summary(results)
    path = write_results("e2e", results, args.out_dir)
    day = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
    (path.parent / f"e2e-summary-{day}.json").write_text(json.dumps(results["summary"], indent=1) + "\n")
    print(json.dumps(results["summary"], indent=1))
    return 0


# ---- the MoE modules that replace transformers' routed experts -------------------------------------------


def _modules() -> tuple[type, type]:
    """The two expert modules (torch.nn.Module subclasses, made on first use: torch imports lazily here)."""
    import torch

    class MoetExperts(torch.nn.Module):
        """A routed-experts module with the attributes MoetMoEMethod.apply reads from a vLLM FusedMoE layer."""

        def __init__(self, ordinal: int, w13: Any, w2: Any) -> None:
            super().__init__()
            self.expert_map = None
            self.moet_cache = None
            self.moet_fp4 = None
            self.moet_ordinal = ordinal
            self.moet_w13, self.moet_w2 = w13, w2
            self.activation = SimpleNamespace(value="silu")

        def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            from moet.vllm.moe_op import apply_moe

            return apply_moe(self, hidden_states, top_k_weights, top_k_index)

    class Bf16Experts(torch.nn.Module):
        """The same experts in bf16 through torch._grouped_mm (the bf16 MoE of moet bench kernels)."""

        def __init__(self, w13: Any, w2: Any) -> None:
            super().__init__()
            self.w13, self.w2 = w13, w2

        def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            from moet.testing.reference import bf16_moe_grouped

            out = bf16_moe_grouped(hidden_states.to(torch.bfloat16), top_k_weights, top_k_index, self.w13, self.w2)
            return out.to(hidden_states.dtype)

    return MoetExperts, Bf16Experts


class FixedFp4:
    """A stand-in FP4 runtime that always serves one fixed slot set per layer (the all-FP4 path)."""

    def __init__(self, slots: list) -> None:
        self.slots = slots

    def route(self, layer: int, ids: Any, owners: Any = None) -> Any:
        return self.slots[layer]


@dataclass
class Model:
    """A loaded transformers model and, per MoE layer, its experts in every form the variants use."""

    name: str
    hf: Any  # the transformers model, bf16 on the GPU
    blocks: list  # the modules whose `.experts` is swapped
    moet: list  # MoetExperts per layer
    bf16: list  # Bf16Experts per layer
    fp4_host: list[tuple[Any, Any]]  # pinned FP4 words per layer (the pool's host copies)
    stacks: list  # the host-side StackedWeight pairs (embedded: kept for the float64 reference)
    slot_bytes: int
    full_layers: int
    expert_weights: int
    dense_bytes: int  # GPU bytes of everything but the routed experts
    model_dir: str | None = None
    store: Any = None  # pinned host store of the base rows (the device cache's host tier), when asked for

    def __post_init__(self) -> None:
        self.resident = [(m.moet_w13, m.moet_w2) for m in self.moet]
        self.current: tuple = ("base", None, None)  # (variant, FP4 runtime, device cache) the blocks point at

    @property
    def layers(self) -> int:
        return len(self.blocks)

    def use(self, variant: str, runtime: Any = None, cache: Any = None) -> None:
        """Point every MoE block at the variant's experts (and the MoE layers at `runtime` and `cache`)."""
        for block, moet, bf16, (w13, w2) in zip(self.blocks, self.moet, self.bf16, self.resident):
            block.experts = bf16 if variant == "bf16" else moet
            moet.moet_fp4 = runtime
            moet.moet_cache = None if cache is None else SimpleNamespace(cache=cache)
            moet.moet_w13, moet.moet_w2 = (w13, w2) if cache is None else (cache.storage.w13, cache.storage.w2)
        self.current = (variant, runtime, cache)


def _attach(hf: Any, name: str, stacks: list, full_layers: int, bf16_from: Callable[[int, Any, Any], tuple]) -> Model:
    """Lay each layer's stacks onto the GPU (the plugin's gpu_layer) and build the variants' modules."""
    import torch

    from moet.kernels.layout import gpu_layer

    moet_experts, bf16_experts = _modules()
    blocks = [layer.mlp for layer in hf.model.layers]
    dense = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if ".experts." not in n)
    moet, bf16, host = [], [], []
    weights = 0
    for ordinal, (block, (s13, s2)) in enumerate(zip(blocks, stacks)):
        w13, w2, fp4 = gpu_layer(s13, s2, torch.device("cuda"), fp4=True)
        moet.append(moet_experts(ordinal, w13, w2))
        host.append(tuple(fp4))
        bf16.append(bf16_experts(*bf16_from(ordinal, block, (s13, s2))))
        e, n, k = w13.shape
        weights += e * n * k + e * w2.shape[1] * w2.shape[2]
    slot_bytes = moet[0].moet_w13.fp4_nbytes() + moet[0].moet_w2.fp4_nbytes()
    return Model(name, hf, blocks, moet, bf16, host, stacks, slot_bytes, full_layers, weights, dense)


def host_store(stacks: list, pin: bool = True) -> Any:
    """The base rows of every layer's experts in a pinned host store (what the device cache fetches from)."""
    from moet.store import PinnedStore
    from moet.store.layout import RowLayout

    s13, s2 = stacks[0]
    layout = RowLayout.for_moe(s13.shape[1], s2.shape[1], s13.scale_kind)
    weights = [[[w13.expert(e), w2.expert(e)] for e in range(w13.num_experts)] for w13, w2 in stacks]
    return PinnedStore.from_weights(layout, weights, pin=pin)


def _fp4_bf16(stack: Any) -> Any:
    """The FP4 tier of every expert of a stack, in bf16 [E, N, K] (the bf16 variant's weights)."""
    import torch

    from moet.quant.codebook import Tier

    e, n, kq = stack.codes.shape
    out = torch.empty(e, n, kq * 4, dtype=torch.bfloat16, device="cuda")
    for i in range(e):
        out[i] = stack.dequantize(i, Tier.PLANES).to("cuda", torch.bfloat16)
    return out


def embedded_model() -> Model:
    """The embedded Qwen3-MoE: dense weights as shipped; experts requantized as the plugin does it."""
    import torch

    from moet.eval.perplexity import load_model
    from moet.formats.experts import iter_routed_experts
    from moet.quant.requant import requantize
    from moet.quant.stacked import StackedWeight
    from moet.models import DEFAULT_MODEL_DIR

    model_dir = str(DEFAULT_MODEL_DIR)
    cfg = _config(model_dir)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    stacks: dict[int, tuple[StackedWeight, StackedWeight]] = {}
    for src in iter_routed_experts(model_dir):
        qw = requantize(src, "planes")
        layer = src.key.layer
        if layer not in stacks:
            stacks[layer] = (StackedWeight.empty(e, 2 * i, h, qw.scale_kind, "planes"), StackedWeight.empty(e, h, i, qw.scale_kind, "planes"))
        w13, w2 = stacks[layer]
        inter = w13.shape[0] // 2
        rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "down": slice(None)}[src.key.proj]
        (w2 if src.key.proj == "down" else w13).put(src.key.expert, rows, qw)
    ordered = [stacks[layer] for layer in sorted(stacks)]
    hf = load_model(model_dir, experts=_zero_experts(model_dir), dtype=torch.bfloat16, device="cuda")
    model = _attach(hf, "embedded", ordered, len(ordered), lambda i, block, s: (_fp4_bf16(s[0]), _fp4_bf16(s[1])))
    model.model_dir = model_dir
    model.store = host_store(ordered)
    return model


def _config(model_dir: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _zero_experts(model_dir: str) -> dict:
    """Placeholder expert matrices for load_model (the variants' own modules replace them)."""
    import torch

    from moet.formats.source import ExpertKey

    cfg = _config(model_dir)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    return {ExpertKey(layer, x, p): torch.zeros(shape) for layer in range(cfg.num_hidden_layers)
            for x in range(e) for p, shape in shapes.items()}


# GPU bytes a frontier layer's expert weight takes while the model is built: its bf16 copy (2), the stacked 2-bit
# codes and FP4 planes random_stored makes on the GPU (0.75 + 1/32 of scales) and the kernels' layout (0.25 + 1/32).
BUILD_BYTES_PER_WEIGHT = 3.07
BUILD_HEADROOM = 0.9  # of the GPU's free memory, less BUILD_RESERVE
BUILD_RESERVE = 4 * 2**30  # random_stored's int64 draws, activations, the allocator's slack


def frontier_layers(name: str, free_bytes: int, asked: int = 0) -> int:
    """The layers of frontier model `name` to build on a GPU with `free_bytes` of memory free: `asked`, or (0) as
    many as have their bf16 experts fit in half that memory ("fit twice"), at least 2; never more than fit beside their
    2-bit copies and the dense weights (ValueError, naming the fix, where `asked` or even one layer does not fit)."""
    if name not in FRONTIER:
        raise ValueError(f"unknown model {name!r}: the frontier models are {', '.join(FRONTIER)}, and embedded")
    if asked < 0:
        raise ValueError(f"--layers {asked}: give a positive count, or 0 for as many as fit")
    g = FRONTIER[name]
    weights = g["experts"] * 3 * g["hidden"] * g["inter"]
    dense = 2 * g["vocab"] * g["hidden"] * 2  # embedding and head, bf16
    fit = int((free_bytes * BUILD_HEADROOM - BUILD_RESERVE - dense) // (weights * BUILD_BYTES_PER_WEIGHT))
    layers = asked or max(1, min(fit, max(2, int(free_bytes // 2 // (2 * weights)))))
    if layers > fit:
        need = (weights * BUILD_BYTES_PER_WEIGHT * layers + dense + BUILD_RESERVE) / BUILD_HEADROOM
        fix = f"use --layers {fit} (at most {fit} fit)" if fit >= 1 else "it needs a GPU with more memory"
        count = f"{layers} layer" + ("s need" if layers > 1 else " needs")
        raise ValueError(f"{name}: {count} about {need / 2**30:.0f} GiB of GPU memory, this GPU has {free_bytes / 2**30:.0f} GiB free: {fix}")
    return layers


def frontier_model(name: str, layers: int, with_store: bool = False) -> Model:
    """A DeepSeek-V3-class model in a frontier geometry, truncated, random weights in real shapes; every layer MoE."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from moet.quant.codebook import Tier
    from moet.testing.random_stacked import random_stored

    g = FRONTIER[name]
    cfg = DeepseekV3Config(
        vocab_size=g["vocab"], hidden_size=g["hidden"], intermediate_size=4 * g["inter"], moe_intermediate_size=g["inter"],
        num_hidden_layers=layers, num_attention_heads=g["heads"], num_key_value_heads=g["heads"],
        n_routed_experts=g["experts"], num_experts_per_tok=g["top_k"], n_shared_experts=1,
        n_group=g["groups"][0], topk_group=g["groups"][1], routed_scaling_factor=2.5, first_k_dense_replace=0,
        kv_lora_rank=512, q_lora_rank=g["q_lora"], qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = DeepseekV3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(before)
    print(f"== {name}: {layers} of {g['full_layers']} layers, H={g['hidden']} I={g['inter']} E={g['experts']} top-{g['top_k']}")
    stacks = []
    for layer in range(layers):
        e, h, i = g["experts"], g["hidden"], g["inter"]
        s13 = random_stored(e, 2 * i, h, "mx32", "cuda", seed=2 * layer, chunk=8, refine=False)
        s2 = random_stored(e, h, i, "mx32", "cuda", seed=2 * layer + 1, chunk=8, refine=False)
        stacks.append((s13, s2))

    def bf16_from(ordinal: int, block: Any, pair: tuple) -> tuple:
        """The FP4 values into transformers' own expert parameters (no second bf16 copy)."""
        mod = block.experts
        with torch.no_grad():
            for stack, param in zip(pair, (mod.gate_up_proj, mod.down_proj)):
                for x in range(stack.codes.shape[0]):
                    param[x].copy_(stack.dequantize(x, Tier.PLANES).to(torch.bfloat16))
        return mod.gate_up_proj, mod.down_proj

    model = _attach(hf, name, stacks, g["full_layers"], bf16_from)
    if with_store:
        model.store = host_store(stacks)
    model.stacks = []  # the host stacks are not needed past the layout (GPU memory)
    del stacks
    torch.cuda.empty_cache()
    return model


# ---- runtimes and the decode loop -------------------------------------------------------------------------


def make_runtime(model: Model, variant: str) -> Any:
    """The engine's FP4 runtime for a variant (None for bf16 and base)."""
    import torch

    from moet.knobs import Knobs
    from moet.tier.pool import GIB
    from moet.vllm.gate_runtime import Fp4Runtime

    fraction = {"pool25": 0.25, "pool100": 1.0, "gate25": 0.25}.get(variant)
    if fraction is None:
        return None
    experts = model.moet[0].moet_w13.shape[0]
    slots = max(1, round(fraction * model.layers * experts))
    knobs = Knobs(w2=True, delta_gb=slots * model.slot_bytes / GIB * (1 + 1e-9), gate=variant == "gate25",
                  gate_tau="budget:0.25", kpi_secs=1e9)
    runtime = Fp4Runtime(knobs, model.layers, experts, model.slot_bytes, torch.device("cuda"))
    for layer, (h13, h2) in enumerate(model.fp4_host):
        runtime.add_layer(layer, h13, h2)
    return runtime


def make_cache(model: Model, variant: str) -> tuple[Any, Any]:
    """The device expert cache (kernels' layout, over the model's pinned host store) and its replay driver
    for a cache variant; (None, None) for the others."""
    import torch

    from moet.kernels.cache_slots import KernelSlots
    from moet.store import ExpertCache, ReplayDriver

    fraction = {"cache50": 0.5}.get(variant)
    if fraction is None:
        return None, None
    experts = model.moet[0].moet_w13.shape[0]
    cache = ExpertCache(model.store, slots=round(fraction * model.layers * experts), device=torch.device("cuda"),
                        storage=KernelSlots)
    return cache, ReplayDriver(cache, fp_max=model.layers + 1, kpi_secs=1e9)


class Decoder:
    """B sequences decoded one token per step from a StaticCache, the step captured in a CUDA graph; with a
    replay driver (device cache) each step is replayed until no expert misses."""

    def __init__(self, model: Model, batch: int, prompt: Any, max_len: int, compile_step: bool, driver: Any = None) -> None:
        import torch
        from transformers import StaticCache

        self.model = model
        self.driver = driver
        self.cache = StaticCache(config=model.hf.config, max_cache_len=max_len)
        variant, runtime, expert_cache = model.current
        model.use(variant, runtime)  # the prompt from resident experts: one pass must hold all it routes to
        with torch.no_grad():
            out = model.hf(input_ids=prompt, past_key_values=self.cache, use_cache=True,
                           cache_position=torch.arange(prompt.shape[1], device="cuda"))
        model.use(variant, runtime, expert_cache)
        self.prompt_logits = out.logits.float()
        self.ids = out.logits[:, -1:].argmax(-1)
        self.pos = torch.full((batch, 1), prompt.shape[1], dtype=torch.int64, device="cuda")
        self.cache_pos = torch.tensor([prompt.shape[1]], dtype=torch.int64, device="cuda")
        step = self._step
        if compile_step:
            # every variant and batch compiles the same model code again: keep Dynamo from falling back to
            # eager after its default 8 recompiles (it did on the H200, 2026-12-03, from the 4th variant on)
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 512)
            step = torch.compile(self._step, dynamic=False)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits = step()

    def _step(self) -> Any:
        # transformers' StaticLayer writes at its own running length, not at cache_position: pin it to the
        # step's position so that every replay (a gate re-run too) rewrites this step's entries
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(self.cache_pos[0])
        out = self.model.hf(input_ids=self.ids, position_ids=self.pos, cache_position=self.cache_pos,
                            past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1]

    def replay(self, runtime: Any) -> Any:
        """One pass of the step (to a fixed point of the device cache's misses when there is one)."""
        def one_pass() -> Any:
            if runtime is not None:
                runtime.begin_pass()
            self.graph.replay()
            return self.logits

        return one_pass() if self.driver is None else self.driver.run(one_pass)

    def advance(self, logits: Any) -> Any:
        """Feed the greedy tokens back and move one position on; returns them."""
        nxt = logits.argmax(-1, keepdim=True)
        self.ids.copy_(nxt)
        self.pos += 1
        self.cache_pos += 1
        return nxt

    def step(self, runtime: Any) -> Any:
        """One engine step: replay, then the runtime's after_logits (gate re-runs replay the same graph)."""
        logits = self.replay(runtime)
        if runtime is not None:
            logits = runtime.after_logits(logits, lambda: self.replay(runtime))
        return logits


def _prompt(model: Model, batch: int, length: int) -> Any:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(7)
    return torch.randint(1, model.hf.config.vocab_size, (batch, length), device="cuda", generator=gen)


def bench_model(model: Model, args: argparse.Namespace) -> dict:
    """Decode tok/s per variant and batch, prefill tok/s, GPU memory per tier, projections."""
    import torch

    from moet.store import CacheTooSmall

    record: dict[str, Any] = {"layers": model.layers, "full_layers": model.full_layers, "decode": {}, "prefill": {},
                              "memory": memory(model)}
    prompt_len = 16
    for variant in args.variants.split(","):
        runtime = make_runtime(model, variant)
        cache, driver = make_cache(model, variant)
        model.use(variant, runtime, cache)
        for batch in (int(b) for b in args.batches.split(",")):
            dec = Decoder(model, batch, _prompt(model, batch, prompt_len), prompt_len + args.warmup + args.steps + 8,
                          args.compile, driver)
            try:
                for _ in range(args.warmup):
                    dec.advance(dec.step(runtime))
            except CacheTooSmall as err:  # a step of this batch routes to more experts than the cache holds
                record["decode"].setdefault(variant, {})[str(batch)] = {"error": str(err)}
                print(f"  {model.name:18} {variant:8} batch {batch:3}: {err}")
                del dec
                continue
            copied0 = runtime.slots.copied_bytes if runtime is not None and runtime.slots is not None else 0
            fires0 = runtime.gate.fires if runtime is not None and runtime.gate is not None else 0
            kpis0 = driver.kpis() if driver is not None else None
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                dec.advance(dec.step(runtime))
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            graph_us = _graph_replay_us(dec)
            entry = {"tok_s": batch * args.steps / seconds, "step_ms": 1e3 * seconds / args.steps, "graph_us": graph_us}
            if runtime is not None:
                entry["fp4_routed_fraction"] = _fp4_fraction(runtime)
                entry["pool_copied_mb_per_step"] = ((runtime.slots.copied_bytes if runtime.slots else 0) - copied0) / 2**20 / args.steps
                if runtime.gate is not None:
                    entry["gate_fire_rate"] = (runtime.gate.fires - fires0) / args.steps
            if driver is not None:
                entry.update(_cache_counters(kpis0, driver.kpis(), args.steps))
            record["decode"].setdefault(variant, {})[str(batch)] = entry
            print(f"  {model.name:18} {variant:8} batch {batch:3}: {entry['tok_s']:8.1f} tok/s "
                  f"(step {entry['step_ms']:.3f} ms, graph {graph_us:.1f} µs)"
                  + (f", FP4 share {entry['fp4_routed_fraction']:.2f}" if "fp4_routed_fraction" in entry else "")
                  + (f", gate fired {entry['gate_fire_rate']:.2f}" if "gate_fire_rate" in entry else "")
                  + (f", cache hit {entry['cache_hit_rate']:.2f}, {entry['replays_per_step']:.2f} replays and "
                     f"{entry['fetch_mb_per_step']:.1f} MB fetched per step" if "cache_hit_rate" in entry else ""))
            del dec
            torch.cuda.empty_cache()
        if args.prefill and cache is None:  # one prefill pass routes to more experts than the cache holds
            record["prefill"][variant] = _prefill(model, args.prefill)
            print(f"  {model.name:18} {variant:8} prefill {args.prefill}: {record['prefill'][variant]['tok_s']:9.0f} tok/s")
        if runtime is not None and runtime.slots is not None:
            record["memory"][f"pool_bytes_{variant}"] = runtime.slots.nbytes
        if cache is not None:
            record["memory"][f"cache_bytes_{variant}"] = cache.storage.nbytes
            record["memory"][f"cache_slots_{variant}"] = cache.slots
        del runtime, cache, driver
        model.use("base")
        torch.cuda.empty_cache()
    record["head_us_b1"] = _head_us(model)
    record["projection"] = projection(record, model)
    record["roofline"] = roofline(record, model)
    return record


def _cache_counters(before: dict, after: dict, steps: int) -> dict:
    """Device-cache figures of the timed steps: hit rate, replays and fetched megabytes per step."""
    lookups = after["lookups"] - before["lookups"]
    return {"cache_hit_rate": 1.0 - (after["misses"] - before["misses"]) / max(lookups, 1),
            "replays_per_step": (after["replays"] - before["replays"]) / steps,
            "fetch_mb_per_step": (after["fetch_bytes"] - before["fetch_bytes"]) / 2**20 / steps,
            "fetch_ms_per_step": 1e3 * (after["fetch_secs"] - before["fetch_secs"]) / steps}


def _graph_replay_us(dec: Decoder) -> float:
    """Median µs of the captured step alone (CUDA events), at the cache position the loop reached."""
    import torch

    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dec.graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _fp4_fraction(runtime: Any) -> float:
    """Of the last pass's routed experts, the share that held an FP4 slot."""
    routed = runtime.routed[:, : runtime.experts].cpu()
    held = runtime.pool.use_fp4.cpu()
    return float((routed & held).sum()) / max(1, int(routed.sum()))


def _prefill(model: Model, tokens: int) -> dict:
    import torch

    ids = _prompt(model, 1, tokens)
    with torch.no_grad():
        model.hf(input_ids=ids, use_cache=False)
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model.hf(input_ids=ids, use_cache=False)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    seconds = statistics.median(times)
    return {"tok_s": tokens / seconds, "ms": 1e3 * seconds}


def _head_us(model: Model) -> float:
    """µs of the final norm + LM head for one token (graph-replayed): what a step costs besides its layers."""
    import torch

    h = torch.randn(1, 1, model.hf.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fn = lambda: model.hf.lm_head(model.hf.model.norm(h))  # noqa: E731
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def memory(model: Model) -> dict:
    """GPU bytes per tier: the 2-bit base (one layout), the bf16 experts, the rest of the model."""
    base = sum(m.moet_w13.base_nbytes() + m.moet_w2.base_nbytes() for m in model.moet)
    bf16 = sum(b.w13.numel() * 2 + b.w2.numel() * 2 for b in model.bf16)
    host = sum(t.numel() * 4 for pair in model.fp4_host for t in pair)
    return {
        "expert_weights": model.expert_weights,
        "base_bytes_gpu": base,
        "expert_bits_per_weight_gpu": 8 * base / model.expert_weights,
        "bf16_expert_bytes_gpu": bf16,
        "dense_bytes_gpu": model.dense_bytes,
        "fp4_host_copy_bytes": host,
        "fp4_slot_bytes": model.slot_bytes,
    }


def projection(record: dict, model: Model) -> dict:
    """Full-model decode tok/s at batch 1 from per-layer step time (graph replay minus the LM head) × layers."""
    out: dict[str, Any] = {"full_layers": model.full_layers, "head_us": record["head_us_b1"]}
    out["original_tok_s_scaled_to_h200"] = ORIGINAL_TOK_S * H200_TBS / ORIGINAL_BW_TBS
    for variant, batches in record["decode"].items():
        if "tok_s" not in batches.get("1", {}) or variant.startswith("cache"):  # a cache step is its fetches and replays, not one graph
            continue
        per_layer = max(0.0, batches["1"]["graph_us"] - record["head_us_b1"]) / model.layers
        out[f"{variant}_layer_us"] = per_layer
        out[f"{variant}_tok_s"] = 1e6 / (record["head_us_b1"] + per_layer * model.full_layers)
    return out


def roofline(record: dict, model: Model) -> dict:
    """What a batch-1 decode step must read per layer at the H200's copy bandwidth, and the speed-up over bf16
    experts that bound allows: the dense weights (attention, shared experts, router) are read by both
    variants, so the whole-model gain is below the experts' 7x. Beside it, the measured per-layer times."""
    cfg = model.hf.config
    layer = model.hf.model.layers[0]
    dense = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if ".experts." not in f".{n}")
    head = sum(p.numel() * p.element_size() for p in (*model.hf.lm_head.parameters(), *model.hf.model.norm.parameters()))
    active = cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size  # routed weights per token
    bits = record["memory"]["expert_bits_per_weight_gpu"]
    out: dict[str, Any] = {"bandwidth_tbs": H200_TBS, "dense_layer_bytes": dense, "head_bytes": head,
                           "bf16_experts_layer_bytes": 2 * active, "base_experts_layer_bytes": active * bits / 8}
    for variant in ("bf16", "base"):
        out[f"{variant}_layer_us"] = (dense + out[f"{variant}_experts_layer_bytes"]) / (H200_TBS * 1e6)
        measured = record["projection"].get(f"{variant}_layer_us")
        if measured:
            out[f"{variant}_layer_us_measured"] = measured
    out["layer_speedup_bound"] = out["bf16_layer_us"] / out["base_layer_us"]
    head_us = head / (H200_TBS * 1e6)
    out["full_model_speedup_bound"] = ((head_us + model.full_layers * out["bf16_layer_us"])
                                       / (head_us + model.full_layers * out["base_layer_us"]))
    return out


# ---- correctness on the embedded model ----------------------------------------------------------------------


def check_embedded(model: Model, args: argparse.Namespace) -> dict:
    """GPU path vs float64 over the same expert weights: prompt log-probs (prefill kernels), decode log-probs
    and greedy tokens (CUDA decode kernels, graph replay), with the dense layers in float32 (the MoE kernels'
    own error) and in bf16 (as served); bf16 experts as the yardstick; a pool of every expert against the
    FP4 copies placed directly (bit for bit)."""
    import dataclasses

    import torch
    from tokenizers import Tokenizer

    from moet.eval.perplexity import load_model
    from moet.formats.source import ExpertKey
    from moet.kernels.layout import Fp4Slots
    from moet.models.data import read_text, split_files, stdlib_files
    from moet.quant.codebook import Tier

    tok = Tokenizer.from_file(str(Path(model.model_dir) / "tokenizer.json"))
    text = "\n".join(read_text(f) for f in split_files(stdlib_files())[1][:3])
    prompt = torch.tensor([tok.encode(text).ids[:64]], device="cuda")
    total, p0 = 256, 64

    def reference(tier: Tier, seq: Any) -> Any:
        """float64 log-probs [T, V] of `seq` with every expert in `tier` (the weights the GPU path represents)."""
        experts = {}
        for layer, (s13, s2) in enumerate(model.stacks):
            inter = s13.shape[0] // 2
            for e in range(s13.num_experts):
                w13, w2 = s13.dequantize(e, tier), s2.dequantize(e, tier)
                experts[ExpertKey(layer, e, "gate")], experts[ExpertKey(layer, e, "up")] = w13[:inter], w13[inter:]
                experts[ExpertKey(layer, e, "down")] = w2
        ref_model = load_model(model.model_dir, experts=experts, dtype=torch.float64, device="cuda")
        with torch.no_grad():
            return torch.log_softmax(ref_model(input_ids=seq).logits, -1)[0]

    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = load_model(model.model_dir, experts=_zero_experts(model.model_dir), dtype=dtype, device="cuda")
        dense = dataclasses.replace(model, hf=hf, blocks=[layer.mlp for layer in hf.model.layers])
        for name, variant, tier in (("base", "base", Tier.NONE), ("fp4", "pool100", Tier.PLANES), ("bf16_experts", "bf16", Tier.PLANES)):
            runtime = make_runtime(dense, variant)
            dense.use(variant, runtime)
            dec = Decoder(dense, 1, prompt, total + 8, False)
            tokens, decode_lp = [int(dec.ids)], []
            for _ in range(total - p0 - 1):
                logits = dec.step(runtime)
                decode_lp.append(torch.log_softmax(logits.double(), -1))
                tokens.append(int(dec.advance(logits)))
            seq = torch.cat([prompt, torch.tensor([tokens], device="cuda")], dim=1)[:, :total]
            with torch.no_grad():
                prefill_lp = torch.log_softmax(hf(input_ids=seq, use_cache=False).logits.double(), -1)[0]
            ref_lp = reference(tier, seq)  # each variant's own tokens: its own reference
            targets = seq[0, 1:]
            ref_t = ref_lp[:-1].gather(-1, targets[:, None]).squeeze(-1)
            gpu_t = prefill_lp[:-1].gather(-1, targets[:, None]).squeeze(-1)
            dec_t = torch.stack(decode_lp)[:, 0].gather(-1, targets[p0:, None]).squeeze(-1)
            greedy_ref = ref_lp[p0 - 1 : total - 1].argmax(-1)
            key = f"{name}_{'fp32' if dtype == torch.float32 else 'bf16'}_dense"
            out[key] = {
                "tokens": total,
                "prefill_mean_abs_dlogprob": float((gpu_t - ref_t).abs().mean()),
                "decode_mean_abs_dlogprob": float((dec_t - ref_t[p0:]).abs().mean()),
                "greedy_agreement": float((greedy_ref == seq[0, p0:total]).double().mean()),
            }
            print(f"  check {key}: {out[key]}")
            del dec, runtime
        del hf, dense
        torch.cuda.empty_cache()
    # pool of every expert (slots filled by commits) vs the same FP4 copies placed directly, bit for bit
    runtime = make_runtime(model, "pool100")
    model.use("pool100", runtime)
    seq_short = prompt[:, :32]
    with torch.no_grad():
        pooled = model.hf(input_ids=seq_short, use_cache=False).logits
        pooled_decode = Decoder(model, 1, prompt, 80, False).replay(runtime).clone()
        direct = FixedFp4([Fp4Slots.every_expert(h13.cuda(), h2.cuda()) for h13, h2 in model.fp4_host])
        model.use("pool100", direct)
        fixed = model.hf(input_ids=seq_short, use_cache=False).logits
        fixed_decode = Decoder(model, 1, prompt, 80, False).replay(None).clone()
    out["pool_of_every_expert_equals_fp4_bitwise"] = {"prefill": bool(torch.equal(pooled, fixed)),
                                                      "decode": bool(torch.equal(pooled_decode, fixed_decode))}
    print(f"  check pool100 == all-FP4: {out['pool_of_every_expert_equals_fp4_bitwise']}")
    # the same step replayed again (what a gate re-run does) gives the same logits, bit for bit
    model.use("base")
    dec = Decoder(model, 1, prompt, 80, False)
    first = dec.replay(None).clone()
    out["replay_bit_identical"] = all(torch.equal(first, dec.replay(None)) for _ in range(3))
    print(f"  check replay bit-identical: {out['replay_bit_identical']}")
    out["cache_decode_equals_resident_bitwise"] = check_cache(model, prompt)
    print(f"  check device cache == resident: {out['cache_decode_equals_resident_bitwise']}")
    out["delta_gb_auto"] = auto_pool(model)
    print(f"  check delta_gb=auto: {out['delta_gb_auto']}")
    model.use("base")
    return out


def check_cache(model: Model, prompt: Any, steps: int = 24) -> dict:
    """Greedy decode through the device cache (half of the experts: misses, replays, evictions) against the
    resident experts, logits compared bit for bit at every step."""
    import torch

    cache, driver = make_cache(model, "cache50")
    model.use("base")
    resident = Decoder(model, 1, prompt, prompt.shape[1] + steps + 8, False)
    model.use("cache50", None, cache)
    cached = Decoder(model, 1, prompt, prompt.shape[1] + steps + 8, False, driver)
    equal = 0
    for _ in range(steps):
        want, got = resident.step(None).clone(), cached.step(None).clone()
        equal += bool(torch.equal(want, got))
        resident.advance(want)
        cached.advance(want)
    k = driver.kpis()
    model.use("base")
    return {"steps": steps, "equal_steps": equal, "cache_slots": cache.slots, "replayed_steps": k["replayed_steps"],
            "hit_rate": round(k["hit_rate"], 3), "fetches": k["fetches"]}


def auto_pool(model: Model) -> dict:
    """delta_gb=auto as the engine sizes it: the pool allocated from the memory left free now, minus the reserve."""
    import torch

    from moet.knobs import Knobs
    from moet.vllm.gate_runtime import Fp4Runtime

    experts = model.moet[0].moet_w13.shape[0]
    runtime = Fp4Runtime(Knobs(w2=True, delta_gb="auto"), model.layers, experts, model.slot_bytes, torch.device("cuda"))
    for layer, (h13, h2) in enumerate(model.fp4_host):
        runtime.add_layer(layer, h13, h2)
    free_before, _ = torch.cuda.mem_get_info()
    runtime.allocate()
    free_after, _ = torch.cuda.mem_get_info()
    return {"free_before_gib": free_before / 2**30, "slots": runtime.pool.slots, "of": model.layers * experts,
            "pool_gib": (runtime.slots.nbytes if runtime.slots else 0) / 2**30, "free_after_gib": free_after / 2**30}


def summary(results: dict) -> dict:
    """The figures the GPU serving issue asks for, from the truncated DeepSeek-V4-Flash model."""
    out: dict[str, Any] = {"device": results["device"], "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    ds = results["models"].get("deepseek-v4-flash")
    if ds is not None:
        b1 = {v: b["1"]["tok_s"] for v, b in ds["decode"].items() if "tok_s" in b.get("1", {})}
        out["decode_tok_s_b1_bf16"] = b1.get("bf16")
        out["decode_tok_s_b1_base"] = b1.get("base")
        if b1.get("bf16") and b1.get("base"):
            out["decode_speedup_b1_base_vs_bf16"] = b1["base"] / b1["bf16"]
        out["expert_bits_per_weight_gpu"] = ds["memory"]["expert_bits_per_weight_gpu"]
        out["projected_full_model_tok_s_b1"] = {k: v for k, v in ds["projection"].items() if k.endswith("tok_s")}
        out["roofline_b1"] = {k: ds["roofline"][k] for k in ("layer_speedup_bound", "full_model_speedup_bound")}
    for name, rec in results["models"].items():
        out.setdefault("models", {})[name] = {
            "layers": rec["layers"],
            "decode_tok_s": {v: {b: round(e["tok_s"], 1) for b, e in batches.items() if "tok_s" in e}
                             for v, batches in rec["decode"].items()},
            "prefill_tok_s": {v: round(p["tok_s"]) for v, p in rec["prefill"].items()},
            "expert_bits_per_weight_gpu": rec["memory"]["expert_bits_per_weight_gpu"],
        }
    if "checks" in results:
        out["checks"] = results["checks"]
    return out
