"""Decode with the FP4 pool and the confidence gate on a transformers model: the algorithm that serves.

The plugin's MoE layer reads the pool's table and reports each step's routed experts; its step
hook calls `moet.tier.gate.run_gated_step`. Here the same pool and the same driver run over a
plain transformers model (float32, CPU), so quality and re-run cost are measured on the real
algorithm rather than on a simulation:

- `ExpertSwitch` keeps, per layer, the 2-bit and the FP4 weights of every routed expert and makes
  the module's expert parameters follow the pool: a promoted expert's weights are its FP4 tier,
  every other expert's its 2-bit base (copied on each commit, between steps, as slots are filled
  on a GPU). A forward pre-hook on each experts module records the routed (layer, expert) counts
  of every forward, which is what the plugin's layer reports.
- `GatedDecoder.step` runs one engine step (a prompt chunk or one token per row) on a KV cache; a
  re-run pass crops the cache back to the step's start, so each pass recomputes exactly that step.

With every expert promoted the switched model *is* the FP4 model (same parameters, same
transformers code), so its logits equal the FP4 path bit for bit (tests/test_quality.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from moet.eval.perplexity import ExpertWeights
from moet.formats.source import ExpertKey
from moet.tier.gate import Gate, StepOutcome, run_gated_step
from moet.tier.pool import Changes, FP4Pool



def _stack(experts: ExpertWeights, layer: int, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's experts as transformers stores them: gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""
    w13 = torch.stack([torch.cat([experts[ExpertKey(layer, e, "gate")], experts[ExpertKey(layer, e, "up")]]) for e in range(n_experts)])
    w2 = torch.stack([experts[ExpertKey(layer, e, "down")] for e in range(n_experts)])
    return w13, w2


class ExpertSwitch:
    """Routed-expert weights of a loaded Qwen3-MoE-style model (fused `gate_up_proj`/`down_proj`)
    that follow an FP4 pool, and the routing each forward used."""

    def __init__(self, model: torch.nn.Module, base: ExpertWeights, fp4: ExpertWeights | None = None) -> None:
        self.modules = [block.mlp.experts for block in model.model.layers]
        self.layers = len(self.modules)
        self.experts = self.modules[0].gate_up_proj.shape[0]
        self.base = [_stack(base, layer, self.experts) for layer in range(self.layers)]
        self.fp4 = None if fp4 is None else [_stack(fp4, layer, self.experts) for layer in range(self.layers)]
        self.routed = torch.zeros(self.layers, self.experts, dtype=torch.int64)
        with torch.no_grad():
            for mod, (w13, w2) in zip(self.modules, self.base):
                mod.gate_up_proj.copy_(w13)
                mod.down_proj.copy_(w2)
        for layer, mod in enumerate(self.modules):
            mod.register_forward_pre_hook(self._recorder(layer), with_kwargs=True)

    def _recorder(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            self.routed[layer] += torch.bincount(top_k_index.reshape(-1), minlength=self.experts)[: self.experts]

        return hook

    @torch.no_grad()
    def apply(self, changes: Changes) -> None:
        """Make the parameters follow a commit: evicted experts back to 2-bit, promoted ones to FP4."""
        if changes and self.fp4 is None:
            raise ValueError("this switch holds no FP4 weights")
        for tier, entries in ((self.base, changes.evicted), (self.fp4, changes.promoted)):
            for layer, expert, _ in entries:
                w13, w2 = tier[layer]
                self.modules[layer].gate_up_proj[expert].copy_(w13[expert])
                self.modules[layer].down_proj[expert].copy_(w2[expert])

    def take_routed(self) -> torch.Tensor:
        """Routed token counts [layers, experts] since the last call."""
        counts = self.routed.clone()
        self.routed.zero_()
        return counts


@dataclass
class DecodeStats:
    """Decode steps only (one token per row; prompt steps are not counted): steps, forward passes
    (re-runs included), seconds in forwards, and the routed (token, expert) pairs that each tier
    served — what a decode step reads, since each routed expert is read once per pass."""

    steps: int = 0
    forwards: int = 0
    seconds: float = 0.0
    base_pairs: int = 0
    fp4_pairs: int = 0


def split_pairs(routed: torch.Tensor, use_fp4: torch.Tensor | None) -> tuple[int, int]:
    """Routed (token, expert) counts [layers, experts] → (pairs served by the 2-bit base, by the FP4 tier)."""
    fp4 = int(routed[use_fp4.cpu()].sum()) if use_fp4 is not None else 0
    return int(routed.sum()) - fp4, fp4


class GatedDecoder:
    """Steps a model on a KV cache with an FP4 pool (or None: fixed weights) and, optionally, the gate."""

    def __init__(self, model: torch.nn.Module, switch: ExpertSwitch, pool: FP4Pool | None = None, gate: Gate | None = None) -> None:
        if gate is not None and pool is None:
            raise ValueError("the gate promotes into a pool")
        self.model, self.switch, self.pool, self.gate = model, switch, pool, gate
        self.stats = DecodeStats()
        self.cache = DynamicCache(config=model.config)

    def reset(self) -> None:
        """A new sequence (the pool, its heat and the gate's state carry over, as in a server)."""
        self.cache = DynamicCache(config=self.model.config)

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, StepOutcome | None]:
        """One engine step for input_ids [rows, tokens]: the final pass's next-token logits [rows, V]."""
        start = self.cache.get_seq_length()
        tally = DecodeStats(steps=1)
        holder: list[torch.Tensor] = []

        def step_fn() -> tuple[torch.Tensor, torch.Tensor]:
            if self.cache.get_seq_length() > start:
                self.cache.crop(start - self.cache.get_seq_length())
            self.switch.take_routed()
            t0 = time.perf_counter()
            logits = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True).logits[:, -1].float()
            tally.seconds += time.perf_counter() - t0
            tally.forwards += 1
            routed = self.switch.take_routed()
            base, fp4 = split_pairs(routed, self.pool.use_fp4 if self.pool is not None else None)
            tally.base_pairs += base
            tally.fp4_pairs += fp4
            holder[:] = [logits, routed]
            return torch.softmax(logits, -1).amax(-1), routed > 0

        if self.gate is None:
            step_fn()
            outcome = None
        else:
            outcome = run_gated_step(step_fn, self.gate, self.pool, self.switch.apply)
        logits, routed = holder
        if self.pool is not None:
            self.pool.record(routed)
        if input_ids.shape[1] == 1:
            for name in ("steps", "forwards", "seconds", "base_pairs", "fp4_pairs"):
                setattr(self.stats, name, getattr(self.stats, name) + getattr(tally, name))
        return logits, outcome


def stepwise_logprobs(decoder: GatedDecoder, windows: torch.Tensor, prefill: int) -> tuple[torch.Tensor, list[bool]]:
    """Teacher-forced decode: per window [S + 1 ids], one step over ids[:prefill], then one step per
    later input token. Returns log-probabilities [W, S − prefill + 1, V] for positions prefill−1 …
    S−1 (targets ids[prefill:]) and, per decode step (not the prompt step), whether the gate fired."""
    rows, fired = [], []
    for window in windows:
        decoder.reset()
        logits, _ = decoder.step(window[None, :prefill])
        out = [logits]
        for token in window[prefill:-1]:
            logits, outcome = decoder.step(token.view(1, 1))
            out.append(logits)
            fired.append(outcome is not None and outcome.fired)
        rows.append(torch.log_softmax(torch.cat(out), -1))
    return torch.stack(rows), fired


@dataclass
class Recovery:
    """Greedy decode with the gate, the FP4 source and the 2-bit base stepped on the same tokens."""

    steps: int = 0
    fired: int = 0
    base_disagreements: int = 0  # base top-1 ≠ source top-1
    recovered: int = 0  # … of which the gated top-1 = source top-1
    gated_disagreements: int = 0  # gated top-1 ≠ source top-1 (recovered or not, new or not)

    @property
    def recovery(self) -> float:
        return self.recovered / self.base_disagreements if self.base_disagreements else float("nan")


@torch.no_grad()
def greedy_recovery(gated: GatedDecoder, source: GatedDecoder, base: GatedDecoder, prompts: torch.Tensor, new_tokens: int) -> Recovery:
    """Real decode (not teacher-forced): the gated system picks every next token greedily; the source
    and the pure 2-bit base read the same prefix on their own KV caches. At each decode step the
    base's top-1 is compared with the source's, and a disagreement counts as recovered when the
    gated step's top-1 equals the source's. The prompt step itself is not counted."""
    result = Recovery()
    for prompt in prompts:
        for decoder in (gated, source, base):
            decoder.reset()
        ids = prompt[None]
        for position in range(new_tokens + 1):
            logits, outcome = gated.step(ids)
            want = int(source.step(ids)[0].argmax())
            plain = int(base.step(ids)[0].argmax())
            got = int(logits.argmax())
            if position > 0:
                result.steps += 1
                result.fired += outcome.fired
                result.base_disagreements += plain != want
                result.recovered += plain != want and got == want
                result.gated_disagreements += got != want
            ids = torch.tensor([[got]])
    return result
