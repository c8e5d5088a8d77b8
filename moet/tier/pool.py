"""The FP4 pool: a fixed number of slots holding hot experts' FP4 tier, and the slot table the forward reads.

Why this shape: the 2-bit base of every expert is always resident; the
pool adds the exact FP4 tier for the experts that matter most, chosen by decayed routing frequency
and, when the confidence gate fires, by the gate. The forward never sees the pool's bookkeeping,
only two device tensors of fixed storage — `slot_table` (int32 [layers, experts], slot or −1) and
`use_fp4` (bool, `slot_table >= 0`) — which change in place and only in `commit()`. The caller
commits between steps, so a captured CUDA graph replays against a table that is never half-updated.

All decisions are made on a *planned* assignment (slot → expert) that `request()` (the gate) and
the proposals of `propose()` (frequency rebalancing, possibly from the `PoolManager` thread)
edit under a lock; `commit()` publishes the difference from the last committed assignment and
returns it as `Changes`, so the caller can copy the promoted experts' FP4 tier into their slots
before the next forward (on CPU, where the whole tier is in host memory, `use_fp4` is enough).

Heat is a per-expert exponentially decayed count of routed tokens (`record()` once per step).
Evictions always take the coldest unprotected resident; a rebalancing swap needs the newcomer to
be hotter than the victim by a hysteresis factor, so that two experts of similar heat do not
trade places every step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Literal, Union

import torch

GIB = 1 << 30


@dataclass(frozen=True)
class Changes:
    """What one `commit()` published: (layer, expert, slot) triples."""

    promoted: list[tuple[int, int, int]] = field(default_factory=list)
    evicted: list[tuple[int, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.promoted or self.evicted)


def pool_slots(
    delta_gb: Union[float, Literal["auto"]],
    slot_bytes: int,
    max_slots: int,
    free_bytes: int | None = None,
    reserve_bytes: int = GIB,
) -> int:
    """Slots that fit the knob `delta_gb` (GiB, or 'auto' = `free_bytes` − `reserve_bytes`), at most `max_slots`.

    `free_bytes` is what the caller measured after allocating the KV cache (vLLM's profile run);
    the pool never takes more than every expert of the model (`max_slots`).
    """
    if slot_bytes <= 0:
        raise ValueError("slot_bytes must be positive")
    if delta_gb == "auto":
        if free_bytes is None:
            raise ValueError("delta_gb='auto' needs the free memory after the KV cache (free_bytes)")
        budget = max(0, free_bytes - reserve_bytes)
    else:
        budget = int(float(delta_gb) * GIB)
    return min(max_slots, budget // slot_bytes)


class FP4Pool:
    """Slots for the FP4 tier of `slots` experts out of `layers` × `experts`; see the module docstring."""

    def __init__(
        self,
        layers: int,
        experts: int,
        slots: int,
        decay: float = 0.98,
        hysteresis: float = 0.25,
        device: str | torch.device = "cpu",
    ) -> None:
        if not 0 <= slots <= layers * experts:
            raise ValueError(f"slots must be in [0, {layers * experts}], got {slots}")
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.layers, self.experts, self.slots = layers, experts, slots
        self.decay, self.hysteresis = decay, hysteresis
        self.slot_table = torch.full((layers, experts), -1, dtype=torch.int32, device=device)
        self.use_fp4 = torch.zeros((layers, experts), dtype=torch.bool, device=device)
        self.heat = torch.zeros(layers * experts, dtype=torch.float64)
        self._committed = torch.full((slots,), -1, dtype=torch.int64)  # slot → flat expert id
        self._planned = self._committed.clone()
        self._where = torch.full((layers * experts,), -1, dtype=torch.int64)  # planned: flat id → slot
        self._proposal: list[tuple[int, int]] = []  # (newcomer, victim or −1)
        self._lock = threading.Lock()
        self.promotions = 0
        self.evictions = 0
        self.commits = 0

    # -- routing statistics ---------------------------------------------------------------------
    def record(self, routed: torch.Tensor) -> None:
        """Fold one step's routing into the heat: `routed` [layers, experts] counts (or a bool mask)."""
        counts = routed.detach().to("cpu", torch.float64).reshape(-1)
        with self._lock:
            self.heat.mul_(self.decay).add_(counts)

    # -- planning ---------------------------------------------------------------------------------
    def planned_mask(self) -> torch.Tensor:
        """bool [layers, experts]: the experts that will hold a slot after the next commit."""
        with self._lock:
            return (self._where >= 0).view(self.layers, self.experts).clone()

    def request(self, wanted: torch.Tensor, protect: torch.Tensor | None = None, limit: int | None = None) -> int:
        """Plan the promotion of `wanted` (bool [layers, experts]); returns how many were newly planned.

        Hottest first; each takes a free slot or evicts the coldest planned resident that is neither
        in `protect` (bool [layers, experts], e.g. the experts of the step being re-run) nor wanted.
        Stops at `limit` promotions or when no slot can be freed.
        """
        wanted_flat = wanted.detach().to("cpu", torch.bool).reshape(-1)
        keep = wanted_flat.clone()
        if protect is not None:
            keep |= protect.detach().to("cpu", torch.bool).reshape(-1)
        with self._lock:
            candidates = torch.nonzero(wanted_flat & (self._where < 0)).flatten()
            order = _by_heat(self.heat, candidates, hottest_first=True)
            done = 0
            for flat in order.tolist():
                if limit is not None and done >= limit:
                    break
                slot = self._free_or_victim_slot(keep)
                if slot < 0:
                    break
                self._assign(slot, flat)
                done += 1
            return done

    def propose(self, max_swaps: int | None = None) -> int:
        """Compute frequency-rebalancing swaps from the current heat (applied at the next commit).

        Non-residents hottest first take free slots, then replace the coldest residents while
        heat(newcomer) > heat(victim) · (1 + hysteresis), at most `max_swaps` replacements (each one
        is a copy into VRAM on a GPU). Safe to call from another thread.
        """
        with self._lock:
            heat = self.heat.clone()
            where = self._where.clone()
        outsiders = torch.nonzero((where < 0) & (heat > 0)).flatten()
        newcomers = _by_heat(heat, outsiders, hottest_first=True).tolist()
        residents = torch.nonzero(where >= 0).flatten()
        victims = _by_heat(heat, residents, hottest_first=False).tolist()
        free = self.slots - residents.numel()
        proposal: list[tuple[int, int]] = []
        swaps = 0
        for flat in newcomers:
            if free > 0:
                proposal.append((flat, -1))
                free -= 1
            elif swaps != max_swaps and victims and heat[flat] > heat[victims[0]] * (1.0 + self.hysteresis):
                proposal.append((flat, victims.pop(0)))
                swaps += 1
            else:
                break
        with self._lock:
            self._proposal = proposal
        return len(proposal)

    def _apply_proposal(self) -> None:
        """Apply the last proposal to the plan, skipping swaps that the plan has since made stale."""
        for flat, victim in self._proposal:
            if self._where[flat] >= 0:
                continue
            if victim < 0:
                free = torch.nonzero(self._planned < 0).flatten()
                if free.numel():
                    self._assign(int(free[0]), flat)
            elif self._where[victim] >= 0:
                self._assign(int(self._where[victim]), flat)
        self._proposal = []

    def _free_or_victim_slot(self, keep: torch.Tensor) -> int:
        """A free planned slot, else the slot of the coldest resident not in `keep`, else −1."""
        free = torch.nonzero(self._planned < 0).flatten()
        if free.numel():
            return int(free[0])
        occupied = self._planned
        evictable = occupied[~keep[occupied]]
        if evictable.numel() == 0:
            return -1
        coldest = _by_heat(self.heat, evictable, hottest_first=False)[0]
        return int(self._where[coldest])

    def _assign(self, slot: int, flat: int) -> None:
        old = int(self._planned[slot])
        if old >= 0:
            self._where[old] = -1
        self._planned[slot] = flat
        self._where[flat] = slot

    # -- publishing ---------------------------------------------------------------------------------
    def commit(self, rebalance: bool = True) -> Changes:
        """Publish the plan (plus the pending proposal if `rebalance`) to the slot table, in place.

        Call between steps only. The caller must fill the returned promotions' slots with their FP4
        tier before the next forward; evicted slots need no work (the table no longer points there).
        """
        with self._lock:
            if rebalance:
                self._apply_proposal()
            changed = torch.nonzero(self._planned != self._committed).flatten().tolist()
            evicted = [(int(self._committed[s]), s) for s in changed if self._committed[s] >= 0]
            promoted = [(int(self._planned[s]), s) for s in changed if self._planned[s] >= 0]
            self._committed.copy_(self._planned)
            table = torch.full((self.layers * self.experts,), -1, dtype=torch.int32)
            table[self._where >= 0] = self._where[self._where >= 0].to(torch.int32)
            self.slot_table.copy_(table.view(self.layers, self.experts))
            self.use_fp4.copy_(self.slot_table >= 0)
            self.promotions += len(promoted)
            self.evictions += len(evicted)
            self.commits += 1
        return Changes(
            promoted=[(*divmod(flat, self.experts), slot) for flat, slot in promoted],
            evicted=[(*divmod(flat, self.experts), slot) for flat, slot in evicted],
        )

    def resident(self) -> list[tuple[int, int, int]]:
        """(layer, expert, slot) of every committed resident."""
        with self._lock:
            held = torch.nonzero(self._committed >= 0).flatten().tolist()
            return [(*divmod(int(self._committed[s]), self.experts), s) for s in held]

    def counters(self) -> dict[str, int]:
        """For moet.status.write_status and the KPI log line."""
        return {
            "pool_slots": self.slots,
            "pool_resident": int((self._committed >= 0).sum()),
            "pool_promotions": self.promotions,
            "pool_evictions": self.evictions,
            "pool_commits": self.commits,
        }


def _by_heat(heat: torch.Tensor, flat_ids: torch.Tensor, hottest_first: bool) -> torch.Tensor:
    """flat_ids ordered by heat (descending or ascending), ties always by id ascending (deterministic)."""
    if flat_ids.numel() == 0:
        return flat_ids
    ids = flat_ids.sort().values
    key = -heat[ids] if hottest_first else heat[ids]
    return ids[torch.argsort(key, stable=True)]


class PoolManager:
    """A daemon thread that recomputes the pool's rebalancing proposal every `interval_s` seconds.

    Only planning runs here (a sort over layers × experts heats); publishing stays with the step
    loop's `commit()`, so the thread never touches anything the forward reads.
    """

    def __init__(self, pool: FP4Pool, interval_s: float = 0.05) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moet-fp4-pool", daemon=True)

    def start(self) -> "PoolManager":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.pool.propose()
