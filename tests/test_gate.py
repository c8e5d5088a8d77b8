"""The confidence gate: fixed and budget τ, the run-time τ file, and the fixed-point driver on a toy
model whose routing depends on which experts are FP4."""

from __future__ import annotations

import os

import pytest
import torch

from moet.knobs import Knobs
from moet.tier.gate import Gate, run_gated_step
from moet.tier.pool import FP4Pool


def test_fixed_tau_fires_on_any_row_at_or_below():
    gate = Gate("0.6")
    assert gate.decide(torch.tensor([0.9, 0.6]))
    assert not gate.decide(torch.tensor([0.61, 0.99]))
    assert gate.decide(torch.tensor([0.1]))
    c = gate.counters()
    assert (c["gate_steps"], c["gate_fires"], c["gate_fire_rate"]) == (3, 2, round(2 / 3, 4))
    assert "2/3 steps fired" in gate.log_line()


def test_from_knobs():
    from moet.vllm.gate_runtime import gate_from_knobs

    gate = gate_from_knobs(Knobs(w2=True, gate=True, delta_gb=1.0, gate_tau="budget:0.1", gate_fp_max=2, gate_promote_max=7))
    assert (gate.mode, gate.target, gate.fp_max, gate.promote_max) == ("budget", 0.1, 2, 7)


@pytest.mark.parametrize("target", [0.10, 0.25])
def test_budget_tracks_the_fire_rate(target):
    """i.i.d. steps of 1..3 rows with skewed top-1 probabilities: the fire rate converges to the
    budget and τ to the budget-quantile of the per-step minimum."""
    gen = torch.Generator().manual_seed(0)
    gate = Gate(f"budget:{target}")
    beta = torch.distributions.Beta(torch.tensor(4.0), torch.tensor(1.5))
    torch.manual_seed(0)
    minima, fires = [], []
    for step in range(6000):
        rows = int(torch.randint(1, 4, (1,), generator=gen))
        top1 = beta.sample((rows,))
        minima.append(float(top1.min()))
        fires.append(gate.decide(top1))
    late = fires[2000:]
    assert abs(sum(late) / len(late) - target) < 0.02
    assert abs(sum(fires[:300]) / 300 - target) < 0.05  # decreasing gains: on budget from the start
    quantile = float(torch.tensor(minima[2000:]).quantile(target))
    assert abs(gate.tau - quantile) < 0.05


def test_tau_file_overrides_at_run_time(tmp_path, caplog):
    path = tmp_path / "tau"
    gate = Gate("0.6", tau_file=path)
    probe = torch.tensor([0.5])
    assert gate.decide(probe)  # no file yet: the knob
    path.write_text("0.3\n")
    assert not gate.decide(probe)
    path.write_text("banana")
    os.utime(path, ns=(1, 1))
    assert not gate.decide(probe) and gate.tau == 0.3  # malformed: previous value kept
    assert "ignoring" in caplog.text
    path.write_text("budget:0.5")
    os.utime(path, ns=(2, 2))
    gate.decide(probe)
    assert gate.mode == "budget" and gate.target == 0.5


LAYERS, EXPERTS = 3, 6


def toy_step(pool: FP4Pool, top1_when_partial: float = 0.3):
    """Layer 0 routes {0, 1}; layer l routes {2c, 2c+1} where c = how many of layer l−1's routed
    experts are FP4, so each promotion changes the routing downstream. top-1 is 0.95 once every
    routed expert is FP4."""

    def step():
        mask = pool.use_fp4
        routed = torch.zeros(LAYERS, EXPERTS, dtype=torch.bool)
        chosen = [0, 1]
        for layer in range(LAYERS):
            routed[layer, chosen] = True
            c = int(mask[layer, chosen].sum())
            chosen = [2 * c, 2 * c + 1]
        all_fp4 = bool((mask | ~routed).all())
        return torch.tensor([0.95 if all_fp4 else top1_when_partial]), routed

    return step


def expected_fixed_point() -> tuple[int, torch.Tensor]:
    """Iterate promotion by hand: (re-runs, FP4 mask) at the fixed point."""
    mask = torch.zeros(LAYERS, EXPERTS, dtype=torch.bool)
    reruns = 0
    while True:
        routed = torch.zeros_like(mask)
        chosen = [0, 1]
        for layer in range(LAYERS):
            routed[layer, chosen] = True
            c = int(mask[layer, chosen].sum())
            chosen = [2 * c, 2 * c + 1]
        if not (routed & ~mask).any():
            return reruns, mask
        mask |= routed
        reruns += 1


def test_gated_step_reaches_the_fixed_point():
    pool = FP4Pool(LAYERS, EXPERTS, LAYERS * EXPERTS)
    gate = Gate("0.6", fp_max=8)
    seen = []
    outcome = run_gated_step(toy_step(pool), gate, pool, seen.append)
    reruns, mask = expected_fixed_point()
    assert outcome.fired and outcome.converged
    assert outcome.passes == reruns == 3
    assert torch.equal(pool.use_fp4, mask)
    assert outcome.promoted == int(mask.sum()) == sum(len(c.promoted) for c in seen)
    assert not (outcome.routed & ~pool.use_fp4).any()
    # the next step finds everything promoted: confident, no fire
    assert not run_gated_step(toy_step(pool), gate, pool, seen.append).fired
    assert gate.counters()["gate_passes"] == 3 and gate.counters()["gate_promotions"] == outcome.promoted


def test_gated_step_limits():
    pool = FP4Pool(LAYERS, EXPERTS, LAYERS * EXPERTS)
    outcome = run_gated_step(toy_step(pool), Gate("0.6", fp_max=2), pool, lambda c: None)
    assert outcome.passes == 2 and not outcome.converged
    pool = FP4Pool(LAYERS, EXPERTS, LAYERS * EXPERTS)
    outcome = run_gated_step(toy_step(pool), Gate("0.6", fp_max=8, promote_max=4), pool, lambda c: None)
    assert outcome.promoted == 4 and int(pool.use_fp4.sum()) == 4 and not outcome.converged


@pytest.mark.parametrize("slots", [6, 5])
def test_gated_step_in_a_pool_of_one_step(slots):
    """Six slots hold one step's routed experts: the fixed point is reached by evicting experts
    that only earlier passes routed. Five cannot: promotions stop, and no eviction ever takes an
    expert that the pass being completed routed."""
    pool = FP4Pool(LAYERS, EXPERTS, slots)
    step = toy_step(pool)
    last_routed = []

    def recording_step():
        top1, routed = step()
        last_routed.append(routed)
        return top1, routed

    def check(changes):
        routed = last_routed[-1]
        assert not any(routed[layer, e] for layer, e, _ in changes.evicted)

    outcome = run_gated_step(recording_step, Gate("0.6", fp_max=8), pool, check)
    _, mask = expected_fixed_point()
    assert outcome.converged == (slots == 6)
    if outcome.converged:
        assert torch.equal(pool.use_fp4, outcome.routed) and int(mask.sum()) > slots
    assert int(pool.use_fp4.sum()) == slots


def test_no_fire_no_rerun():
    pool = FP4Pool(LAYERS, EXPERTS, 4)
    outcome = run_gated_step(toy_step(pool), Gate("0.2"), pool, lambda c: pytest.fail("no commit expected"))
    assert not outcome.fired and outcome.passes == 0 and not pool.use_fp4.any()
