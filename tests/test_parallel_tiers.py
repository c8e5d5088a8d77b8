"""The tiers under tensor and expert parallelism: every rank serves from its own pack (its slice of every
expert, or its own experts), and the device cache's replay and the gate's re-runs are decided on all
ranks together, so a rank that found all of its experts still runs the pass its peers replay.

Two real ranks each time: torch.distributed (gloo) processes around the real cache, replay driver and
gate, and real vLLM with TP = 2 and with --enable-expert-parallel, against TP = 1. Last, the modular
kernel the plugin hands vLLM (so that its all2all backends, not its naive dispatch, serve expert
parallelism across data-parallel ranks) against float64."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from moet.quant.codebook import dequantize_base
from moet.store import ExpertCache, PinnedStore, ReplayDriver
from moet.store.build import fuse_rows
from moet.testing.synthetic_moe import SyntheticMoE, make_model
from moet.tier.gate import Gate, run_gated_step
from moet.tier.pool import FP4Pool
from tests.test_cpu_moe import H, I, random_expert, reference, stack
from tests.test_vllm_plugin import PROMPTS, run_vllm, start_vllm

LAYERS, EXPERTS, TOKENS, STEPS = 3, 8, 3, 4
HALF = EXPERTS // 2


def _model() -> SyntheticMoE:
    return make_model(LAYERS, EXPERTS, 64, 32, 2, zipf_s=1.2, seed=5)


def _prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(6)
    return [torch.randn(TOKENS, 64, dtype=torch.float64, generator=gen) for _ in range(STEPS)]


def _experts_out(model: SyntheticMoE, h: torch.Tensor, top_i: torch.Tensor, gates: torch.Tensor, mats_of: dict) -> torch.Tensor:
    """float64 SwiGLU experts of the routed pairs whose expert has matrices in `mats_of` (global id → mats)."""
    out = torch.zeros_like(h)
    for expert, mats in sorted(mats_of.items()):
        tok, pos = (top_i == expert).nonzero(as_tuple=True)
        w13, w2 = (dequantize_base(qw).to(torch.float64) for qw in mats)
        gate, up = (h[tok] @ w13.T).chunk(2, dim=-1)
        out.index_add_(0, tok, (F.silu(gate) * up) @ w2.T * gates[tok, pos, None])
    return out


def _forward(model: SyntheticMoE, x: torch.Tensor, partials: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
             routed: torch.Tensor | None = None) -> torch.Tensor:
    """The synthetic MoE stack with each layer's expert output from `partials` (a rank's share summed over
    the ranks); `routed` [layers, EXPERTS] records the routing."""
    h = x.to(torch.float64)
    for layer in range(model.layers):
        logits = h @ model.router[layer] + model.prior[layer]
        top_v, top_i = logits.topk(model.top_k, dim=-1)
        if routed is not None:
            routed[layer, top_i.flatten()] = True
        h = h + partials(layer, h, top_i, torch.softmax(top_v, dim=-1))
        h = h / h.pow(2).mean(-1, keepdim=True).sqrt()
    return h


def _rank(rank: int, init: str, out_dir: str) -> None:
    """One expert-parallel rank (experts [rank·HALF, (rank+1)·HALF)): a device cache over its own rows, cold
    on rank 0 and holding all of rank 1's experts, so only rank 0 misses; then a gated step where only rank
    0 has experts to promote. Every pass all-reduces the layer outputs, as vLLM's forward does."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))

    def ranks_max(count: int) -> int:
        value = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value)

    model, ours = _model(), list(range(rank * HALF, (rank + 1) * HALF))
    store = PinnedStore.from_weights(model.layout, [[model.weights[layer][g] for g in ours] for layer in range(LAYERS)])
    cache = ExpertCache(store, slots=LAYERS * HALF)
    if rank == 1:
        cache.fetch([(layer, e) for layer in range(LAYERS) for e in range(HALF)])
    local_ids = torch.full((EXPERTS,), -1, dtype=torch.int64)
    local_ids[ours] = torch.arange(HALF)

    def partials(layer: int, h: torch.Tensor, top_i: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        ids = torch.unique(top_i).tolist()
        found = cache.expert_weights(layer, local_ids[ids].tolist())  # other ranks' experts: -1, not a miss
        out = _experts_out(model, h, top_i, gates, {g: m for g, m in zip(ids, found) if m is not None})
        dist.all_reduce(out)
        return out

    driver = ReplayDriver(cache, fp_max=2 * LAYERS, agree=ranks_max)
    outs = [driver.run(lambda x=x: _forward(model, x, partials)) for x in _prompts()]
    pool = FP4Pool(LAYERS, HALF, LAYERS * HALF)
    if rank == 1:  # everything of rank 1 already at FP4: it has nothing to promote
        pool.request(torch.ones(LAYERS, HALF, dtype=torch.bool))
        pool.commit(rebalance=False)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        routed = torch.zeros(LAYERS, EXPERTS, dtype=torch.bool)
        h = driver.run(lambda: _forward(model, _prompts()[0], partials, routed))
        return torch.softmax(h, dim=-1).amax(-1), routed[:, ours]

    gated = run_gated_step(step, Gate("1.0", fp_max=4), pool, lambda changes: None, agree=ranks_max)
    lookups, misses = cache.counts()
    torch.save({"outs": outs, "kpis": driver.kpis(), "misses": misses, "passes": gated.passes, "promoted": gated.promoted,
                "converged": gated.converged}, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_replay_and_gate_decide_on_every_rank(tmp_path: Path) -> None:
    """Two gloo ranks under expert parallelism: rank 0's cache misses, rank 1's never does, yet both replay
    the same steps (their all-reduces pair up) and the outputs are exactly the resident ones; rank 1 has
    nothing to promote, yet re-runs every gated pass rank 0 asks for. Without the agreement rank 1 would
    skip those passes and its next all-reduce would meet rank 0's replay."""
    ctx = mp.spawn(_rank, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, join=False)
    while not ctx.join(timeout=120):
        pass
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model = _model()

    def both_ranks(layer: int, h: torch.Tensor, top_i: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        halves = [_experts_out(model, h, top_i, gates, {g: model.weights[layer][g] for g in range(r * HALF, (r + 1) * HALF)})
                  for r in range(2)]
        return halves[0] + halves[1]

    want = [_forward(model, x, both_ranks) for x in _prompts()]
    for r in ranks:
        assert all(torch.equal(got, w) for got, w in zip(r["outs"], want, strict=True))
    assert ranks[0]["misses"] > 0 and ranks[1]["misses"] == 0
    assert ranks[1]["kpis"]["replays"] == ranks[0]["kpis"]["replays"] > 0  # rank 1 replayed without a miss
    assert ranks[0]["promoted"] > 0 and ranks[1]["promoted"] == 0
    assert ranks[1]["passes"] == ranks[0]["passes"] > 0 and ranks[0]["converged"]


def _close(got: list[dict], want: list[dict], tol: float = 1e-3) -> None:
    """Same greedy tokens, every shared top log-prob within `tol` (prompt and generated positions)."""
    for a, b in zip(got, want, strict=True):
        assert a["tokens"] == b["tokens"]
        for step_a, step_b in zip(a["prompt_logprobs"][1:] + a["logprobs"], b["prompt_logprobs"][1:] + b["logprobs"], strict=True):
            shared = step_a.keys() & step_b.keys()
            assert shared and max(abs(step_a[t] - step_b[t]) for t in shared) < tol


@pytest.mark.vllm
def test_two_ranks_serve_the_tiers_as_one(checkpoint, tmp_path: Path) -> None:
    """TP = 2 (each rank's slice of every expert) and expert parallelism (each rank its two of the four
    experts), each with packs and a device cache that misses (cold: the first steps replay), answer as
    TP = 1 fully resident: the same greedy tokens, log-probs within 1e-3."""
    model = checkpoint("qwen3_moe", "nvfp4")
    spec = {"model": str(model), "prompts": PROMPTS, "dtype": "float32"}
    tiers = {"VLLM_MOE_W2": "1", "VLLM_MOE_W2_BASE_CACHE_GB": "0.001", "VLLM_MOE_W2_STORE_THREADS": "1"}
    resident = start_vllm(spec, VLLM_MOE_W2="1")  # tests/test_vllm_plugin.py's TP = 1 run
    tp = start_vllm({**spec, "tp": 2}, **tiers, VLLM_MOE_W2_STORE_DIR=str(tmp_path / "tp"))
    ep = run_vllm({**spec, "tp": 2, "expert_parallel": True}, **tiers, VLLM_MOE_W2_STORE_DIR=str(tmp_path / "ep"))
    for kind, held in (("tp", [None, None]), ("ep", [[0, 1], [2, 3]])):
        for rank, experts in enumerate(held):
            sidecar = json.loads((tmp_path / kind / f"rank{rank}.json").read_text())
            assert sidecar["expert_ids"] == experts and sidecar["experts"] == len(experts or range(4)), (kind, rank)
    _close(tp.result(), resident.result())
    _close(ep, resident.result())


def test_modular_kernel_equals_the_float64_experts() -> None:
    """MoetMoEMethod builds vLLM's modular kernel (prepare/finalize for the parallel layout around
    MoetExperts) as vLLM's own quantization methods do; through it, an expert-parallel rank holding
    experts 4..7 of 8 of a 2-bit layer answers as a float64 loop over those experts' decoded weights
    (other ranks' experts contribute nothing)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    from moet.vllm.config import MoetConfig
    from moet.vllm.moe import MoetExperts, MoetMoEMethod

    experts, local, tokens, top_k = 8, 4, 9, 2
    parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=1, ep_size=2, tp_rank=0, pcp_rank=0, dp_rank=0, ep_rank=1,
                                      sp_size=1, use_ep=True, all2all_backend="allgather_reducescatter", enable_eplb=False)
    moe = FusedMoEConfig(num_experts=experts, experts_per_token=top_k, hidden_dim=H, intermediate_size=I, num_local_experts=local,
                         num_logical_experts=experts, activation=MoEActivation.SILU, device="cpu",
                         routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel, in_dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    w13 = [fuse_rows([random_expert(I, H, "mx32", gen), random_expert(I, H, "mx32", gen)]) for _ in range(local)]
    w2 = [random_expert(H, I, "mx32", gen) for _ in range(local)]
    layer = torch.nn.Module()
    layer.moet_w13, layer.moet_w2 = stack(w13, "mx32"), stack(w2, "mx32")
    layer.expert_map = torch.tensor([-1] * local + list(range(local)), dtype=torch.int32)
    layer.moet_cache = layer.moet_fp4 = None
    layer.moet_ordinal, layer.activation, layer.global_num_experts = 0, MoEActivation.SILU, experts
    layer._expert_routing_tables = lambda: None
    method = MoetMoEMethod(moe, MoetConfig("mxfp4"))
    method._init_moe_kernel(layer)
    assert isinstance(method.moe_kernel.prepare_finalize, MoEPrepareAndFinalizeNoDPEPModular)
    assert isinstance(method.moe_kernel.fused_experts, MoetExperts) and method.supports_internal_mk
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    ids[0] = torch.tensor([5, 1], dtype=torch.int32)  # one of ours, one of the other rank's
    weights = torch.rand(tokens, top_k, generator=gen)
    got = method.apply(layer, x, weights, ids, None, None)
    want = reference(x, weights, layer.expert_map[ids.long()], w13, w2, torch.zeros(local, dtype=torch.bool),
                     torch.ones(local, dtype=torch.bool))
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.linalg.norm(got.double() - want) / torch.linalg.norm(want) < 1e-5


def test_an_expert_parallel_pack_holds_its_rank_experts(checkpoint, tmp_path: Path) -> None:
    """Rank 1 of two expert-parallel ranks packs experts 2 and 3 only, as rows 0 and 1, byte for byte the
    rows of the one-rank pack; asked for other experts (another rank count or placement) it is rebuilt."""
    from moet.store.build import checkpoint_identity, write_pack_from_checkpoint
    from moet.store.layout import HEADER_WORDS
    from moet.store.pack import open_pack

    model = checkpoint("qwen3_moe", "nvfp4")
    whole = write_pack_from_checkpoint(model, tmp_path / "one", rank=0)
    ours = write_pack_from_checkpoint(model, tmp_path / "ep", rank=1, experts=[2, 3])
    assert (ours.experts, ours.sidecar.expert_ids, whole.sidecar.expert_ids) == (2, [2, 3], None)
    for layer in range(whole.layers):
        for local, expert in enumerate([2, 3]):
            got, want = ours.read_row(layer, local), whole.read_row(layer, expert)
            assert torch.equal(got[HEADER_WORDS * 4 :], want[HEADER_WORDS * 4 :]) and int(got[:16].view(torch.int32)[3]) == local
    identity = checkpoint_identity(model)
    layout, layers = ours.layout, ours.layers
    assert open_pack(tmp_path / "ep", 1, identity, layout, 2, layers, [2, 3]) is not None
    assert open_pack(tmp_path / "ep", 1, identity, layout, 2, layers, [0, 1]) is None
    assert write_pack_from_checkpoint(model, tmp_path / "ep", rank=1, experts=[0, 1]).sidecar.expert_ids == [0, 1]
