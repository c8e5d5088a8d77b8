"""The confidence gate: re-run a low-confidence decode step with its routed experts promoted to FP4.

Why: the 2-bit base is right most of the time; where the model is
unsure of the next token, a small weight error is most likely to flip it. So after a step's
forward, if any row's next-token top-1 probability is ≤ τ, the step's routed experts are promoted
into the FP4 pool and the step is computed again — to a fixed point, because the promoted experts
change the hidden states and with them the routing of later layers.

τ comes from `gate_tau`: a fixed number, or `budget:F`, which adapts τ online so that the gate fires
on about a fraction F of steps (users think in re-run cost, and the right τ differs per model).
The adaptation is a Robbins–Monro quantile tracker on the step's decision statistic (the lowest
top-1 probability of the step's rows): τ ← clip(τ + η_n·(F − fired), 0, 1), whose fixed point is
the F-quantile of that statistic; η_n = max(η, 1/n) over the n steps since the budget was set —
decreasing gains find the quantile within tens of steps, and the floor η keeps τ tracking the
statistic when the text (or the pool's contents) changes its distribution. A file (`gate_tau_file`) overrides the knob at run time; it is
re-read whenever its mtime changes, and a malformed file keeps the previous setting (logged).

`run_gated_step` is the one driver of a gated step; the vLLM step hook and the evaluation harness
(moet.eval.decode) both call it, so the benchmark measures the algorithm that serves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moet.tier.pool import Changes, FP4Pool

log = logging.getLogger(__name__)

#: A step function computes the step (again) with the pool's current table and returns the
#: top-1 next-token probability of each row (float [rows]) and the experts it routed to
#: (bool [layers, experts]).
StepFn = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def parse_tau(value: str) -> tuple[str, float]:
    """'0.6' → ("fixed", 0.6); 'budget:0.25' → ("budget", 0.25). Raises ValueError."""
    text = value.strip()
    mode = "fixed"
    if text.startswith("budget:"):
        mode, text = "budget", text[len("budget:"):]
    number = float(text)
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{value!r} must be in [0, 1]")
    return mode, number


class Gate:
    """Fire decisions and counters of the confidence gate (thread-compatible, one step at a time)."""

    def __init__(
        self,
        tau: str = "0.60",
        tau_file: str | Path | None = None,
        fp_max: int = 3,
        promote_max: int = 0,
        rate: float = 0.02,
    ) -> None:
        self.mode, self.tau = parse_tau(tau)
        self.target = self.tau if self.mode == "budget" else None
        if self.mode == "budget":
            self.tau = 0.5  # start in the middle; the tracker moves it
        self.tau_file = Path(tau_file) if tau_file else None
        self._file_mtime: int | None = None
        self.fp_max, self.promote_max, self.rate = fp_max, promote_max, rate
        self._budget_steps = 0
        self.steps = self.fires = self.passes = self.promotions = self.unconverged = 0

    def _reload(self) -> None:
        """Apply the tau file if it changed since the last look (one stat per step)."""
        if self.tau_file is None:
            return
        try:
            mtime = self.tau_file.stat().st_mtime_ns
        except OSError:
            return
        if mtime == self._file_mtime:
            return
        self._file_mtime = mtime
        try:
            mode, value = parse_tau(self.tau_file.read_text())
        except (OSError, ValueError) as exc:
            log.warning("gate: ignoring %s (%s); keeping tau=%s", self.tau_file, exc, self.describe_tau())
            return
        self.mode = mode
        if mode == "budget":
            self.target = value  # keep the current τ as the tracker's start
            self._budget_steps = 0
        else:
            self.target, self.tau = None, value
        log.info("gate: tau set to %s from %s", self.describe_tau(), self.tau_file)

    def describe_tau(self) -> str:
        return f"budget:{self.target:g} (tau now {self.tau:.3f})" if self.mode == "budget" else f"{self.tau:g}"

    def decide(self, top1: torch.Tensor) -> bool:
        """Whether this step fires: some row's top-1 probability ≤ τ. Updates the budget tracker."""
        self._reload()
        fired = bool((top1 <= self.tau).any())  # τ compared in the probabilities' dtype
        self.steps += 1
        self.fires += fired
        if self.mode == "budget":
            self._budget_steps += 1
            gain = max(self.rate, 1.0 / self._budget_steps)
            self.tau = min(1.0, max(0.0, self.tau + gain * (self.target - fired)))
        return fired

    def counters(self) -> dict[str, float | int]:
        """For moet.status.write_status (the supervisor and `moet status` read these)."""
        return {
            "gate_steps": self.steps,
            "gate_fires": self.fires,
            "gate_fire_rate": round(self.fires / self.steps, 4) if self.steps else 0.0,
            "gate_passes": self.passes,
            "gate_promotions": self.promotions,
            "gate_unconverged": self.unconverged,
            "gate_tau": round(self.tau, 4),
        }

    def log_line(self) -> str:
        c = self.counters()
        return (
            f"gate: {c['gate_fires']}/{c['gate_steps']} steps fired ({100 * c['gate_fire_rate']:.1f}%), "
            f"{c['gate_passes']} re-run passes, {c['gate_promotions']} promotions, "
            f"{c['gate_unconverged']} without a fixed point, tau {self.describe_tau()}"
        )


@dataclass
class StepOutcome:
    """One gated step: the final pass's routing (for pool.record), and what the gate did."""

    routed: torch.Tensor
    fired: bool
    passes: int  # re-run passes after the first
    promoted: int
    converged: bool  # the last pass routed only to FP4-resident experts (or the gate did not fire)


def run_gated_step(step_fn: StepFn, gate: Gate, pool: FP4Pool, on_commit: Callable[[Changes], None],
                   agree: Callable[[int], int] | None = None) -> StepOutcome:
    """Run one step through the gate: compute, decide, and re-run with promotions to a fixed point.

    After the first pass, if the gate fires, the experts routed by the latest pass that are not in
    the pool are promoted (at most `promote_max` over the whole step; 0 = no limit), committed
    without frequency rebalancing, handed to `on_commit` (which must make the next forward see
    them), and the step is run again — until a pass routes only to promoted experts (the fixed
    point: that pass equals the FP4 forward for this step), or `fp_max` re-runs, or nothing more
    can be promoted. A promotion never evicts an expert that the latest pass routed (those make the
    fixed point); experts only earlier passes routed may go, coldest first, so a pool that holds one
    step's routed experts suffices. The caller keeps the last pass's output.

    Under tensor or expert parallelism every rank runs each pass: `agree` gives the largest number of
    experts any rank promoted (the ranks' routing agrees, but under expert parallelism each promotes
    its own experts), and the step is re-run when any rank promoted one.
    """
    top1, routed = step_fn()
    outcome = StepOutcome(routed=routed, fired=gate.decide(top1), passes=0, promoted=0, converged=True)
    if not outcome.fired:
        return outcome
    budget = gate.promote_max or None
    while True:
        missing = routed & ~pool.use_fp4.to(routed.device)
        left = None if budget is None else budget - outcome.promoted
        promoted = 0
        if bool(missing.any()) and outcome.passes < gate.fp_max and left != 0:
            pool.request(missing, protect=routed, limit=left)
            changes = pool.commit(rebalance=False)
            promoted = len(changes.promoted)
            if promoted:
                outcome.promoted += promoted
                on_commit(changes)
        if not (promoted if agree is None else agree(promoted)):
            break
        top1, routed = step_fn()
        outcome.passes += 1
    outcome.converged = not bool((routed & ~pool.use_fp4.to(routed.device)).any())
    outcome.routed = routed
    gate.passes += outcome.passes
    gate.promotions += outcome.promoted
    gate.unconverged += not outcome.converged
    return outcome
