"""Replay to a fixed point: run a step with the device cache, fetch its misses, run it again.

A pass with no miss computed every routed expert, so its output is bit-identical to a fully
resident forward. Strict mode fails the step when misses persist after `fp_max` replays;
`approximate` and a miss tolerance answer with zeroed experts, and say so in the log and KPIs.

Under tensor or expert parallelism every rank runs each pass (its collectives pair with the other
ranks'), so the decision to replay is taken on the largest miss count of all ranks (`agree`): a rank
that found all of its experts replays beside the one that did not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from moet.errors import MoetError
from moet.store.cache import ExpertCache

log = logging.getLogger("moet.store")
T = TypeVar("T")
# The largest value of a count over the ranks that run each forward pass together (one rank: itself).
Agree = Callable[[int], int]


class ReplayError(MoetError):
    """Strict mode: a step still had missing experts after the last replay."""


@dataclass
class StepCounts:
    steps: int = 0
    zero_miss_steps: int = 0  # steps whose first pass found every expert resident
    replayed_steps: int = 0
    replays: int = 0
    degraded_steps: int = 0  # answered with zeroed experts (approximate mode or miss tolerance)


class ReplayDriver:
    """Runs steps through an ExpertCache until no expert is missing, and reports KPIs."""

    def __init__(self, cache: ExpertCache, mode: str = "strict", fp_max: int = 4, miss_tol: int = 0,
                 kpi_secs: float = 30.0, on_report: Callable[[dict[str, Any]], None] | None = None,
                 agree: Agree | None = None) -> None:
        if mode not in ("strict", "approximate"):
            raise ValueError(f"replay mode {mode!r}: strict or approximate")
        self.cache, self.mode, self.fp_max, self.miss_tol = cache, mode, fp_max, miss_tol
        self.kpi_secs, self.on_report = kpi_secs, on_report
        self.agree: Agree = agree or (lambda count: count)
        self.counts = StepCounts()
        self._last_kpi = time.monotonic()

    def run(self, step: Callable[[], T], decode: bool = True) -> T:
        """The step's output from its first pass without a miss on any rank (or a logged degraded answer)."""
        cache, counts = self.cache, self.counts
        cache.begin_step()
        out = step()
        misses = cache.pending()
        most = self.agree(len(misses))
        counts.steps += 1
        if not most:
            counts.zero_miss_steps += 1
        elif most <= self.miss_tol:
            cache.fetch(misses, decode)
            counts.degraded_steps += 1
            log.warning("step answered with %d zeroed experts (VLLM_MOE_W2_BASE_MISS_TOL=%d)", most, self.miss_tol)
            most = 0
        else:
            counts.replayed_steps += 1
        for _ in range(self.fp_max):
            if not most:
                break
            cache.fetch(misses, decode)
            cache.begin_pass()
            out = step()
            counts.replays += 1
            misses = cache.pending()
            most = self.agree(len(misses))
        if most:
            cache.fetch(misses, decode)  # the next step finds them
            if self.mode == "strict":
                raise ReplayError(
                    f"{most} experts still missing after VLLM_MOE_W2_FP_MAX={self.fp_max} replays; strict mode "
                    "fails the request rather than answer with zeroed experts: raise VLLM_MOE_W2_FP_MAX or "
                    "VLLM_MOE_W2_BASE_CACHE_GB, or set VLLM_MOE_W2_REPLAY_MODE=approximate"
                )
            counts.degraded_steps += 1
            log.warning("approximate mode: step answered with %d zeroed experts after %d replays", most, self.fp_max)
        self._maybe_report()
        return out

    def kpis(self) -> dict[str, Any]:
        """Hit rate, zero-miss step fraction, replay rate, fetch bytes and time, host-tier counters."""
        lookups, misses = self.cache.counts()
        c, cache, store = self.counts, self.cache, self.cache.store.stats
        steps = max(c.steps, 1)
        return {
            **asdict(c),
            "lookups": lookups,
            "misses": misses,
            "hit_rate": 1.0 - misses / lookups if lookups else 1.0,
            "zero_miss_fraction": c.zero_miss_steps / steps,
            "replay_rate": c.replayed_steps / steps,
            "fetches": cache.fetches,
            "fetch_bytes": cache.fetch_bytes,
            "fetch_secs": round(cache.fetch_secs, 6),
            "cache_slots": cache.slots,
            "host_hits": store.hits,
            "host_misses": store.misses,
            "pack_read_bytes": store.read_bytes,
            "pack_read_secs": round(store.read_secs, 6),
        }

    def report(self) -> dict[str, Any]:
        """Log the KPI line, hand the KPIs to `on_report` (the plugin writes its status file) and persist
        the host tier's heat now."""
        k = self.kpis()
        log.info(
            "tiers: hit %.3f, zero-miss steps %.3f, replayed %.3f, degraded %d, fetched %.1f MiB in %.3f s",
            k["hit_rate"], k["zero_miss_fraction"], k["replay_rate"], k["degraded_steps"], k["fetch_bytes"] / 2**20, k["fetch_secs"],
        )
        if self.on_report is not None:
            self.on_report(k)
        self.cache.store.persist()
        self._last_kpi = time.monotonic()
        return k

    def _maybe_report(self) -> None:
        if time.monotonic() - self._last_kpi >= self.kpi_secs:
            self.report()
