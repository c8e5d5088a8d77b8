"""The evaluation harness with the FP4 pool and the gate (moet.eval.decode): with every expert
promoted — a full pool, or τ = 1 — the logits equal the FP4 path bit for bit; the switched
parameters always follow the slot table; the quality metrics against direct formulas."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from moet.eval.decode import ExpertSwitch, GatedDecoder
from moet.eval.perplexity import expert_weights, load_model
from moet.formats.source import ExpertKey
from moet.tier.gate import Gate
from moet.tier.pool import FP4Pool


@pytest.fixture(scope="module")
def tiny(checkpoint):
    path = checkpoint("qwen3_moe", "nvfp4-experts")
    return path, expert_weights(path, "base"), expert_weights(path, "fp4")


def _switched(tiny, slots=None):
    path, base, fp4 = tiny
    model = load_model(path, base)
    switch = ExpertSwitch(model, base, fp4)
    layers, experts = switch.layers, switch.experts
    pool = FP4Pool(layers, experts, layers * experts if slots is None else slots)
    return model, switch, pool


def _ids(vocab, shape, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_full_pool_is_the_fp4_model(tiny, single_thread):
    path, _, fp4 = tiny
    model, switch, pool = _switched(tiny)
    pool.request(torch.ones_like(pool.use_fp4))
    switch.apply(pool.commit())
    reference = load_model(path, fp4)
    ids = _ids(model.config.vocab_size, (2, 24))
    assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


@torch.no_grad()
def test_tau_one_decode_equals_fp4_decode(tiny, single_thread):
    """τ = 1 fires on every step; each step's fixed point runs only FP4 experts, so greedy decode
    with the gate reproduces the FP4 model's decode, logits bit for bit."""
    path, _, fp4 = tiny
    model, switch, pool = _switched(tiny)
    gate = Gate("1.0", fp_max=16)
    decoder = GatedDecoder(model, switch, pool, gate)
    reference = load_model(path, fp4)
    cache = DynamicCache(config=reference.config)
    ids = _ids(model.config.vocab_size, (1, 12), seed=1)
    for _ in range(6):
        got, outcome = decoder.step(ids)
        want = reference(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].float()
        assert outcome.fired and outcome.converged
        assert torch.equal(got, want)
        ids = want.argmax(-1, keepdim=True)
    assert gate.counters()["gate_fires"] == 6 and gate.counters()["gate_passes"] >= 1


@torch.no_grad()
def test_parameters_follow_the_table(tiny, single_thread):
    _, base, fp4 = tiny
    model, switch, pool = _switched(tiny, slots=3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        pool.record(torch.rand(pool.use_fp4.shape, generator=gen))
        pool.request(torch.rand(pool.use_fp4.shape, generator=gen) < 0.4)
        switch.apply(pool.commit())
        for layer, mod in enumerate(switch.modules):
            for e in range(switch.experts):
                tier = fp4 if pool.use_fp4[layer, e] else base
                want = torch.cat([tier[ExpertKey(layer, e, "gate")], tier[ExpertKey(layer, e, "up")]])
                assert torch.equal(mod.gate_up_proj[e], want)
                assert torch.equal(mod.down_proj[e], tier[ExpertKey(layer, e, "down")])


@torch.no_grad()
def test_routing_is_recorded_and_bytes_accounted(tiny, single_thread):
    model, switch, pool = _switched(tiny, slots=2)
    pool.request(torch.ones_like(pool.use_fp4))
    switch.apply(pool.commit())
    decoder = GatedDecoder(model, switch, pool, bytes_base=1.0, bytes_fp4=10.0)
    ids = _ids(model.config.vocab_size, (2, 5))
    counts_seen = []
    original = switch.take_routed

    def spy():
        counts = original()
        counts_seen.append(counts)
        return counts

    switch.take_routed = spy
    decoder.step(ids)
    counts = counts_seen[-1]
    k = model.config.num_experts_per_tok
    assert counts.sum(-1).tolist() == [ids.numel() * k] * switch.layers
    fp4_pairs = int(counts[pool.use_fp4].sum())
    assert math.isclose(decoder.stats.expert_bytes, (counts.sum() - fp4_pairs) * 1.0 + fp4_pairs * 10.0)
    assert torch.allclose(pool.heat.view_as(counts), counts.double())
