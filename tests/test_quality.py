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
def test_routing_is_recorded_and_pairs_accounted(tiny, single_thread):
    model, switch, pool = _switched(tiny, slots=2)
    pool.request(torch.ones_like(pool.use_fp4))
    switch.apply(pool.commit())
    decoder = GatedDecoder(model, switch, pool)
    seen = []
    original = switch.take_routed
    switch.take_routed = lambda: seen.append(original()) or seen[-1]
    k = model.config.num_experts_per_tok
    decoder.step(_ids(64, (2, 5)))  # a prompt step: routed, recorded in the heat, not in the decode stats
    counts = seen[-1]
    assert counts.sum(-1).tolist() == [10 * k] * switch.layers
    assert torch.allclose(pool.heat.view_as(counts), counts.double())
    assert decoder.stats.steps == 0 and decoder.stats.base_pairs == 0
    decoder.step(_ids(64, (2, 1)))
    counts = seen[-1]
    fp4_pairs = int(counts[pool.use_fp4].sum())
    assert (decoder.stats.steps, decoder.stats.forwards) == (1, 1)
    assert (decoder.stats.base_pairs, decoder.stats.fp4_pairs) == (2 * k * switch.layers - fp4_pairs, fp4_pairs)


def test_compare_against_direct_formulas():
    from moet.eval.compare import compare

    source = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    variant = torch.log(torch.tensor([[[0.25, 0.5, 0.25], [0.2, 0.2, 0.6]]]))
    targets = torch.tensor([[0, 2]])
    got = compare(variant, source, targets)
    kl0 = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    kl1 = 0.2 * math.log(0.5) + 0.8 * math.log(0.8 / 0.6)
    assert math.isclose(got["kl_per_token"], (kl0 + kl1) / 2, rel_tol=1e-6)
    assert math.isclose(got["perplexity"], math.exp(-(math.log(0.25) + math.log(0.6)) / 2), rel_tol=1e-6)
    assert got["top1_agreement"] == 0.5 and got["tokens"] == 2
    assert compare(source, source, targets)["kl_per_token"] == 0.0


@torch.no_grad()
def test_greedy_recovery_extremes(tiny, single_thread):
    """τ = 1 with room for every expert recovers every disagreement; a gate that never fires is
    the 2-bit base and recovers none."""
    from moet.eval.decode import greedy_recovery

    path, base, fp4 = tiny
    prompts = _ids(64, (2, 6), seed=3)

    def plain(weights):
        model = load_model(path, weights)
        return GatedDecoder(model, ExpertSwitch(model, weights))

    results = {}
    for tau in ("1.0", "0.0"):
        model, switch, pool = _switched(tiny)
        gated = GatedDecoder(model, switch, pool, Gate(tau, fp_max=16))
        results[tau] = greedy_recovery(gated, plain(fp4), plain(base), prompts, new_tokens=8)
    full, never = results["1.0"], results["0.0"]
    assert full.steps == never.steps == 16
    assert full.fired == 16 and never.fired == 0
    assert full.gated_disagreements == 0 and full.recovered == full.base_disagreements
    assert never.recovered == 0 and never.gated_disagreements == never.base_disagreements > 0


@torch.no_grad()
def test_stepwise_matches_batch_teacher_forcing(tiny, single_thread):
    from moet.eval.decode import stepwise_logprobs
    from moet.eval.perplexity import iter_logprobs

    path, base, _ = tiny
    model = load_model(path, base)
    windows = _ids(64, (2, 11), seed=4)
    stepped, fired = stepwise_logprobs(GatedDecoder(model, ExpertSwitch(model, base)), windows, prefill=4)
    batch = next(iter_logprobs(model, windows, batch=2))
    assert stepped.shape == (2, 7, model.config.vocab_size) and fired == [False] * 12
    assert torch.allclose(stepped, batch[:, 3:], atol=1e-4)


def test_ideal_gate_coverage_counts_low_confidence_disagreements():
    from moet.eval.compare import ideal_gate_coverage

    # four positions, confidence 0.4 < 0.5 < 0.7 < 0.9; the variant disagrees at 0.4 and at 0.9
    variant = torch.log(torch.tensor([[0.4, 0.35, 0.25], [0.5, 0.3, 0.2], [0.7, 0.2, 0.1], [0.05, 0.9, 0.05]]))
    source = torch.log(torch.tensor([[0.1, 0.8, 0.1], [0.6, 0.2, 0.2], [0.8, 0.1, 0.1], [0.8, 0.1, 0.1]]))
    got = ideal_gate_coverage(variant, source, [0.25, 1.0])
    assert got == {"0.25": 0.5, "1": 1.0}


@torch.no_grad()
def test_fp8_activation_experts_match_the_block_scaled_emulation(single_thread):
    """The quality bench's FP8-activation variant (moet.eval.variants.mx_activation_experts) computes a layer
    as moet.kernels.mx's float64 emulation of the sm_120a kernel does (weights through its e4m3 operands and
    UE8M0 scales, activations in 1 or 2 e4m3 terms): an independent path to the same numbers; one term is
    visibly coarser than two, and two terms stay near the unquantized layer."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from moet.eval.variants import mx_activation_experts
    from moet.kernels.glue import select_experts
    from moet.kernels.mx import mx_moe_reference
    from moet.quant.codebook import Tier
    from moet.testing.random_stacked import random_stored

    experts, hidden, inter = 6, 128, 64
    s13 = random_stored(experts, 2 * inter, hidden, "mx32", seed=3, refine=False)
    s2 = random_stored(experts, hidden, inter, "mx32", seed=4, refine=False)
    module = torch.nn.Module()
    module.gate_up_proj = torch.stack([s13.dequantize(e, Tier.NONE) for e in range(experts)]).float()
    module.down_proj = torch.stack([s2.dequantize(e, Tier.NONE) for e in range(experts)]).float()
    module.act_fn = F.silu
    model = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(mlp=SimpleNamespace(experts=module))]))
    x = torch.randn(9, hidden)
    weights, ids = select_experts(torch.randn(9, experts), 2)
    plain = torch.zeros(9, hidden, dtype=torch.float64)
    for t in range(9):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (module.gate_up_proj[e].double() @ x[t].double()).chunk(2)
            plain[t] += weights[t, j].double() * (module.down_proj[e].double() @ (F.silu(gate) * up))
    errors = {}
    for terms in (1, 2):
        mx_activation_experts(model, terms)
        got = module.forward(x, ids, weights)
        ref = mx_moe_reference(x, weights, ids, s13, s2, terms)
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5, terms
        errors[terms] = ((got.double() - plain).norm() / plain.norm()).item()
    assert errors[2] < 1e-2 < errors[1] < 0.2, errors


def _e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """float64 → the nearest e4m3 value (ties to even), by hand: 3 mantissa bits above 2^-6, steps of 2^-9 below,
    saturating at ±448."""
    exponent = torch.floor(torch.log2(v.abs().clamp(min=2.0**-6)))
    step = torch.exp2(exponent - 3)
    return (torch.round(v / step) * step).clamp(-448.0, 448.0)  # torch.round: ties to even


def test_fp8_rows_round_to_e4m3_with_one_scale_per_row(single_thread):
    """moet.eval.variants.fp8_rows against e4m3 rounding written out in float64: activation rows scaled by
    amax / 448 (float32), weight rows by a power of two; a zero row stays zero."""
    from moet.eval.variants import fp8_rows

    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1.0], [3e-4], [250.0], [0.0], [1.0]])
    x[4, 7] = 9.0  # an outlier: the row's small values fall into e4m3's subnormals
    scale = (x.abs().amax(-1, keepdim=True) / 448.0).double()
    ref = torch.where(scale > 0, _e4m3_round(x.double() / scale.clamp(min=1e-30)) * scale, 0.0)
    assert torch.equal(fp8_rows(x), ref.float())  # the product rounded to x's float32
    scale2 = torch.exp2(torch.ceil(torch.log2(scale[:3])))
    assert torch.equal(fp8_rows(x[:3], power_of_two=True).double(), _e4m3_round(x[:3].double() / scale2) * scale2)
    assert not torch.equal(fp8_rows(x[:3], power_of_two=True), fp8_rows(x[:3]))


def test_fp8_weight_rows_keep_the_2bit_base_exact_over_16_binades(single_thread):
    """A 2-bit base row (±1, ±4 times a UE8M0 block scale) is exact in e4m3 with its power-of-two row scale while
    its block exponents span 16 binades (2^b, b = b_max … b_max − 15); a block one binade lower loses its ±1s."""
    from moet.eval.variants import fp8_rows

    gen = torch.Generator().manual_seed(1)
    codes = torch.tensor([-4.0, -1.0, 1.0, 4.0])[torch.randint(0, 4, (2, 17, 32), generator=gen)]
    codes[:, :, 0] = 4.0  # every block holds its largest magnitude
    exponents = torch.tensor([[3.0 - b for b in range(16)] + [3.0], [3.0 - b for b in range(17)]])
    w = (codes * torch.exp2(exponents)[:, :, None]).flatten(1)
    q = fp8_rows(w, power_of_two=True)
    assert torch.equal(q[0], w[0])
    low = w[1, 16 * 32:]  # 2^-13: its ±1 are 2^-10 of the row scale 2^-3, half e4m3's smallest step (ties to 0)
    assert torch.equal(q[1, : 16 * 32], w[1, : 16 * 32])
    assert torch.equal(q[1, 16 * 32:], torch.where(low.abs() == 4 * 2.0**-13, low, 0.0))


@torch.no_grad()
@pytest.mark.parametrize("round_weights", [True, False])
def test_token_fp8_experts_compute_the_layer_in_float64(single_thread, round_weights):
    """The quality bench's per-token FP8 variants (moet.eval.variants.token_fp8_experts) compute a layer as float64
    math over e4m3-rounded operands does (the rounding written out by hand): inputs per token, SiLU·up rounded to
    bf16 then per pair, weights per row with a power-of-two scale (or, as the FP8 prefill kernel, exact)."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from moet.eval.variants import token_fp8_experts
    from moet.kernels.glue import select_experts
    from moet.quant.codebook import Tier
    from moet.testing.random_stacked import random_stored

    experts, hidden, inter = 4, 64, 32
    s13 = random_stored(experts, 2 * inter, hidden, "mx32", seed=5, refine=False)
    s2 = random_stored(experts, hidden, inter, "mx32", seed=6, refine=False)
    module = torch.nn.Module()
    module.gate_up_proj = torch.nn.Parameter(torch.stack([s13.dequantize(e, Tier.NONE) for e in range(experts)]).float())
    module.down_proj = torch.nn.Parameter(torch.stack([s2.dequantize(e, Tier.NONE) for e in range(experts)]).float())
    module.act_fn = F.silu
    w13, w2 = module.gate_up_proj.double().clone(), module.down_proj.double().clone()
    model = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(mlp=SimpleNamespace(experts=module))]))
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(2))
    weights, ids = select_experts(torch.randn(6, experts, generator=torch.Generator().manual_seed(3)), 2)

    def rows(v, power_of_two=False):
        scale = (v.float().abs().amax(-1, keepdim=True) / 448.0).double()
        if power_of_two:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        return _e4m3_round(v / scale) * scale

    ref = torch.zeros(6, hidden, dtype=torch.float64)
    xq = rows(x.double())
    for t in range(6):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = ((rows(w13[e], True) if round_weights else w13[e]) @ xq[t]).chunk(2)
            h = (F.silu(gate) * up).to(torch.bfloat16).double()
            ref[t] += weights[t, j].double() * ((rows(w2[e], True) if round_weights else w2[e]) @ rows(h[None])[0])
    token_fp8_experts(model, round_weights)
    got = module.forward(x, ids, weights)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5
