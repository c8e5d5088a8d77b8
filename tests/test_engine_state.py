"""Two MoE models in one process keep separate engine states (moet.vllm.engine): summary, FP4 pool and
gate, pack store. Built the way the plugin builds them, with stand-in layers instead of vLLM's."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import torch

from moet.formats.experts import RoutedExperts
from moet.knobs import Knobs
from moet.quant.stacked import StackedWeight
from moet.vllm.engine import MoetEngine
from moet.vllm.moe_op import apply_moe
from moet.vllm.step_hook import attach


class Activation(Enum):
    SILU = "silu"


class StandInModel(torch.nn.Module):
    """A model whose MoE layers carry what MoetMoEMethod leaves on vLLM's layers."""

    def __init__(self, engine: MoetEngine, model_dir: Path) -> None:
        super().__init__()
        with RoutedExperts(model_dir) as stream:
            sources = list(stream)
        layers = sorted({s.key.layer for s in sources})
        self.moe = torch.nn.ModuleList()
        for index in layers:
            layer = torch.nn.Module()
            layer.moet_engine, layer.moet_ordinal = engine, engine.add_layer()
            layer.expert_map, layer.moet_cache, layer.activation = None, None, Activation.SILU
            self.moe.append(layer)
        gate = next(s for s in sources if s.key.proj == "gate")
        inter, hidden = gate.shape
        experts = len({s.key.expert for s in sources})
        tiers = engine.expert_tiers(torch.device("cpu"))
        for layer, index in zip(self.moe, layers):
            layer.moet_w13 = StackedWeight.empty(experts, 2 * inter, hidden, "nv16", engine.tier)
            layer.moet_w2 = StackedWeight.empty(experts, hidden, inter, "nv16", engine.tier)
            if tiers is not None:
                tiers.fill(layer.moet_ordinal, layer.moet_w13, layer.moet_w2)
            else:
                for src in (s for s in sources if s.key.layer == index):
                    rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}.get(src.key.proj)
                    stack = layer.moet_w2 if rows is None else layer.moet_w13
                    stack.put(src.key.expert, rows or slice(None), engine.quantize(src))
            slot_bytes = (layer.moet_w13.tier_nbytes() + layer.moet_w2.tier_nbytes()) // experts
            layer.moet_fp4 = engine.fp4_runtime(experts, slot_bytes, torch.device("cpu"))
            engine.summary.layer_done(layer.moet_w13, layer.moet_w2, torch.device("cpu"))
        self.hidden, self.experts = hidden, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(2).repeat(x.shape[0], 1).to(torch.int32)
        weights = torch.full(ids.shape, 0.5)
        for layer in self.moe:
            x = x + apply_moe(layer, x, weights, ids)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def test_two_models_keep_separate_engine_states(checkpoint, tmp_path: Path, single_thread) -> None:
    model_dir = checkpoint("qwen3_moe", "nvfp4")
    first = MoetEngine(Knobs(w2=True, delta_gb=1.0, gate=True, store_dir=str(tmp_path / "a")), str(model_dir))
    second = MoetEngine(Knobs(w2=True), str(model_dir))
    a, b = attach(StandInModel(first, model_dir)), attach(StandInModel(second, model_dir))
    assert (a.moet_engine, b.moet_engine) == (first, second)
    assert first.summary.created == first.summary.done == second.summary.created == len(a.moe) > 0
    assert first.fp4 is not None and second.fp4 is None and second.tiers is None
    assert first.tiers.pack.path.parent == tmp_path / "a" and not (tmp_path / "b").exists()
    assert a.moet_step_hook.fp4 is first.fp4 and not hasattr(b, "moet_step_hook")  # b needs no step hook
    first.fp4.begin_pass()
    b(torch.randn(3, b.hidden))
    assert not first.fp4.routed.any()  # the second model's forward does not touch the first's pool
    a.moet_step_hook.forward(torch.randn(3, a.hidden))  # the model's own forward (the hook's needs vLLM)
    assert first.fp4.routed[:, :2].all() and not first.fp4.routed[:, 2:].any()
