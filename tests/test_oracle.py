"""moet.kernels.oracle: the backend of a forward and the layout a layer's weights are converted to."""

from __future__ import annotations

import pytest
import torch

from moet.kernels import cpu_build
from moet.kernels.cpu import is_biased, moe_forward
from moet.kernels.oracle import MoeBackend, convert_to_moe_kernel_format, select_moe_backend
from moet.testing.random_stacked import random_stored


def test_cpu_layers_keep_the_stored_tensors_and_run_a_cpu_backend() -> None:
    w13, w2 = random_stored(2, 32, 128, "mx32", seed=1), random_stored(2, 128, 16, "mx32", seed=2)
    assert convert_to_moe_kernel_format(w13, w2, torch.device("cpu"), fp4=True) == (w13, w2, [])
    kernel = MoeBackend.CPU_KERNEL if cpu_build.load() else MoeBackend.CPU_TORCH
    assert select_moe_backend(torch.device("cpu"), 1) == select_moe_backend(torch.device("cpu"), 8192) == kernel


def test_cpu_calls_the_kernel_does_not_take_go_to_the_pytorch_path() -> None:
    """An expert at the FP4 tier or gpt-oss's biases / swigluoai: the PyTorch path, whatever the build; the
    PyTorch path computes them, the kernel refuses a biased call."""
    cpu = torch.device("cpu")
    assert select_moe_backend(cpu, 4, torch.tensor([False, True])) == MoeBackend.CPU_TORCH
    assert select_moe_backend(cpu, 4, biased=True) == MoeBackend.CPU_TORCH
    assert is_biased("swigluoai", None, None) and is_biased("silu", torch.zeros(2, 64), None) and not is_biased("silu", None, None)
    w13, w2 = random_stored(2, 64, 128, "mx32", seed=3), random_stored(2, 128, 32, "mx32", seed=4)
    x, weights, ids = torch.randn(3, 128), torch.ones(3, 1), torch.tensor([[0], [1], [0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="CPU_TORCH"):
        moe_forward(x, weights, ids, w13, w2, "swigluoai", backend=MoeBackend.CPU_KERNEL)
    with pytest.raises(ValueError, match="not a CPU backend"):
        moe_forward(x, weights, ids, w13, w2, backend=MoeBackend.TRITON)


@pytest.mark.parametrize("gluon", [True, False])
def test_gpu_pick_by_token_count_and_the_kernels_present(monkeypatch: pytest.MonkeyPatch, gluon: bool) -> None:
    """The oracle's GPU choice by token count, given which kernels load (set here: CI has no GPU; the GPU test
    below checks the same on a real device): the CUDA kernels up to 384 tokens beside the Gluon prefill, up to
    512 without it; past that Gluon, else Triton."""
    from moet.kernels import cuda, oracle

    monkeypatch.setattr(cuda, "available", lambda index: True)
    monkeypatch.setattr(oracle, "gluon_prefill_available", lambda index: gluon)
    prefill = MoeBackend.GLUON_PREFILL if gluon else MoeBackend.TRITON
    last_cuda = 384 if gluon else 512
    assert [oracle.gpu_backends(0, t)[0] for t in (1, 64, last_cuda)] == [MoeBackend.CUDA_DECODE] * 3
    assert [oracle.gpu_backends(0, t)[0] for t in (last_cuda + 1, 8192)] == [prefill] * 2
    assert sorted(oracle.gpu_backends(0, 385)) == sorted({MoeBackend.CUDA_DECODE, prefill, MoeBackend.TRITON})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_backend_by_token_count() -> None:
    from moet.kernels import cuda

    from moet.kernels.oracle import gluon_prefill_available, gpu_backends

    device = torch.device("cuda", torch.cuda.current_device())
    prefill = MoeBackend.GLUON_PREFILL if gluon_prefill_available(device.index) else MoeBackend.TRITON
    assert select_moe_backend(device, cuda.MAX_TOKENS + 1) == prefill
    decode = MoeBackend.CUDA_DECODE if cuda.available(device.index) else MoeBackend.TRITON
    assert select_moe_backend(device, 1) == decode
    assert gpu_backends(device.index, 1) == ([MoeBackend.CUDA_DECODE] if cuda.available(device.index) else []) + [MoeBackend.TRITON]
    assert sorted(gpu_backends(device.index, cuda.MAX_TOKENS + 1)) == sorted({decode, prefill, MoeBackend.TRITON})


def test_gpu_entry_point_takes_a_gpu_backend_and_its_configs() -> None:
    """fused_moe_2bit refuses, before any launch, a CPU backend or configs of the other GPU backend."""
    pytest.importorskip("triton")
    from moet.kernels.layout import gpu_layer
    from moet.kernels.moe import default_configs, fused_moe_2bit

    w13, w2, _ = gpu_layer(random_stored(2, 256, 128, "mx32", seed=5), random_stored(2, 128, 128, "mx32", seed=6), torch.device("cpu"), fp4=False)
    x, weights, ids = torch.randn(1, 128), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="not a GPU backend"):
        fused_moe_2bit(x, weights, ids, w13, w2, backend=MoeBackend.CPU_KERNEL)
    with pytest.raises(ValueError, match="configs for the 'triton' kernels"):
        fused_moe_2bit(x, weights, ids, w13, w2, configs=default_configs(1, 128, 128), backend=MoeBackend.CUDA_DECODE)
    with pytest.raises(ValueError, match="GLUON_PREFILL serves prefill"):
        fused_moe_2bit(x, weights, ids, w13, w2, backend=MoeBackend.GLUON_PREFILL)


def test_stage_tunings_fit_each_stage_to_one_wave() -> None:
    """Each stage takes the 6-blocks-per-SM tuning where its pair grid (≤ 16 tokens) fits one wave of them on 132 SMs
    (792 blocks of 32 rows) and the rows it stages fit 24 KiB (six blocks an SM share its shared memory), else the
    staged activations where a pass's rows (one n-tile: at most 8) fit 64 KiB, in the pair grid (≤ 16 tokens) its warps
    streaming several row blocks each where K is at most 2,048 and K / 128 a multiple of 8 (w2 here), and its pass
    capped at 3 rows where more would pass 40 KiB, else the default; grids worked out by hand for DeepSeek-V4-Flash
    (H 4096, I 2048, top-6) and Kimi-K2 (H 7168, I 2048, top-8)."""
    from moet.kernels import cuda
    from moet.kernels.moe import default_configs

    wide, staged, default = cuda.WIDE_TUNING, cuda.STAGED_TUNING, cuda.DEFAULT_TUNING
    capped = "r8b1k1x2_r4b1k1x2_c3"
    streamed = "r8b1k1x2_r4b1k1x2_s"
    assert cuda.STREAMED_TUNING == streamed
    tunings = lambda t, h, i, k: tuple(c.tuning for c in default_configs(t, h, i, "cuda", k, 132))  # noqa: E731
    assert tunings(1, 4096, 2048, 6) == (wide, wide)  # 6 pairs × 128 row blocks = 768 ≤ 792, both stages
    assert tunings(1, 7168, 2048, 8) == (staged, streamed)  # w13 8 × 128 = 1,024, w2 8 × 224: staged 14,352 B
    assert tunings(4, 4096, 2048, 6) == (staged, streamed)  # 24 × 128 = 3,072 blocks; 4 rows × 8,208 B ≤ 40 KiB
    assert tunings(5, 4096, 2048, 6) == (capped, streamed)  # 5 × 8,208 = 41,040 B > 40,960: 3 rows
    assert tunings(6, 4096, 2048, 6) == (capped, streamed)  # 6 × 8,208 = 49,248 B > 40 KiB: 3 rows, 24,624 B
    assert tunings(3, 7168, 2048, 8) == (capped, streamed)  # w13 3 × 14,352 B = 43,056 > 40 KiB: a cap of all three
    assert tunings(4, 7168, 2048, 8) == (capped, streamed)  # w13 4 × 14,352 B = 57,408: 3 rows; w2 4 × 4,112 B
    assert tunings(5, 7168, 2048, 8) == (capped, streamed)  # w13 5 × 14,352 B = 71,760 > 64 KiB, capped 43,056 B
    assert tunings(8, 4096, 2048, 6) == (capped, streamed)  # w13 8 × 8,208 B = 65,664 > 65,536, capped 24,624 B
    assert default_configs(1, 7168, 2048, "cuda", 8, sms=264)[0].tuning == wide  # twice the SMs: 1,024 ≤ 1,584
    assert tunings(9, 4096, 2048, 6) == (capped, streamed)  # a pass would hold 8 rows: w13 capped, w2 8 × 4,112 B
    assert tunings(16, 7168, 2048, 8) == (capped, streamed)  # the last pair grid
    assert tunings(16, 12288, 2048, 8)[0] == default  # three rows of K 12,288 take 73,824 B > 64 KiB
    assert tunings(17, 7168, 2048, 8) == (default, staged)  # the pass grid: no cap, w2 not streamed
    assert tunings(64, 7168, 2048, 8) == (default, staged)  # w13 8 × 14,352 B = 114,816 B; w2 8 × 4,112 B
    assert tunings(65, 4096, 2048, 6) == (default, staged)  # one n-tile, the same per-stage rule
    assert tunings(512, 7168, 2048, 8) == (default, staged)  # a pass still holds 8 rows
    # streamed only where a row block is short and its chunks fill whole rings: w13 of H 2,048 (K 2,048) streams,
    # K 2,176 (17 chunks) and an I of 1,536 (12 chunks: not a multiple of the ring of 8) take the staged pick
    assert tunings(4, 2048, 1024, 8) == (streamed, streamed)
    assert tunings(4, 2176, 1024, 8)[0] == staged
    assert tunings(4, 4096, 1536, 8) == (staged, staged)
    # where the grid fits one wave, the staged rows decide: w2 (K 2,048) stages 5 × 4,112 = 20,560 B, 6 × 4,112 > 24 KiB
    assert default_configs(5, 4096, 2048, "cuda", 6, sms=10**5)[1].tuning == wide
    assert default_configs(6, 4096, 2048, "cuda", 6, sms=10**5)[1].tuning == streamed
    assert default_configs(16, 4096, 1024, "cuda", 6, sms=10**5)[1].tuning == wide  # w2 K 1,024: 8 × 2,064 B
    # in the pass grid (past 16 tokens) never the wide tuning (its one-wave rule counts pair blocks), even where they fit
    assert default_configs(17, 4096, 1024, "cuda", 6, sms=10**5)[1].tuning == staged


def test_staging_past_the_shared_limit_runs_the_x1_twin_or_says_why() -> None:
    """A staging half (x2, x3 in either half of the name) asks for its pass's rows as dynamic shared memory, up to what
    the GPU lets its entry point ask: STAGED_SHARED_LIMIT (160 KiB) on sm_90, whose blocks may opt into 227 KiB less
    their static shared memory (2,064 B here), and 99 KiB less it on sm_120 (the CUDA Programming Guide's table), where
    asking 160 KiB would be refused by the driver. Past it (8 rows of K 10,240 take 8 × 20,496 = 163,968 B; on sm_120
    Kimi-K2's w13 at 8 tokens 8 × 14,352 = 114,816 B) an x2 tuning runs as its built x1 twin without any, and an x3
    tuning, which has no twin built, is refused with the tuning, the bytes and the way out."""
    from moet.kernels import cuda

    assert cuda.dynamic_shared_limit(227 << 10, 2064) == cuda.STAGED_SHARED_LIMIT == 163840
    sm120 = cuda.dynamic_shared_limit(99 << 10, 2064)
    assert sm120 == 101376 - 2064
    assert cuda.stages_activations("r8b1k1x0_r4b1k1x2") and cuda.stages_activations(cuda.WIDE_TUNING)
    assert not cuda.stages_activations(cuda.DEFAULT_TUNING)
    limit = cuda.STAGED_SHARED_LIMIT
    assert cuda._stage_launch(cuda.DEFAULT_TUNING, 8, 4096, limit) == (0, cuda.DEFAULT_TUNING)
    assert cuda._stage_launch(cuda.STAGED_TUNING, 8, 4096, limit) == (8 * 8208, cuda.STAGED_TUNING)
    assert cuda._stage_launch(cuda.STAGED_TUNING, 8, 10240, limit) == (0, "r8b1k1x1_r4b1k1x1")
    assert cuda._stage_launch(cuda.STAGED_TUNING, 8, 7168, limit) == (114816, cuda.STAGED_TUNING)
    assert cuda._stage_launch(cuda.STAGED_TUNING, 8, 7168, sm120) == (0, "r8b1k1x1_r4b1k1x1")
    assert cuda._stage_launch(cuda.STAGED_TUNING, 4, 7168, sm120) == (57408, cuda.STAGED_TUNING)
    assert cuda._stage_launch(cuda.WIDE_TUNING, 1, 10240, limit) == (20496, cuda.WIDE_TUNING)
    with pytest.raises(ValueError, match=r"r6b1k2x3_r2b1k2x0_o6: 163968 B .* the 163840 B this GPU allows and no x1 "
                                         r"twin \(r6b1k2x1_r2b1k2x0_o6\)"):
        cuda._stage_launch(cuda.WIDE_TUNING, 8, 10240, limit)


def test_a_capped_pass_stages_its_rows_and_launches_the_uncapped_entry_point() -> None:
    """"_c<N>" at the end of a tuning caps a staged pass at N activation rows: the launch asks N rows of shared memory
    (min(T, N) · (2K + 16) B; Kimi-K2's w13 at 8 tokens and N = 2: 28,704 B, where 8 rows take 114,816 B), passes N as
    an argument of the uncapped entry point (no entry point of its own, streamed ones included), and past the GPU's
    limit runs the x1 twin as an uncapped tuning does; N outside 1-8 is refused with the tuning."""
    from moet.kernels import cuda

    staged = cuda.STAGED_TUNING
    assert cuda.pass_cap(staged) == cuda.PASS_ROWS == 8 and cuda.pass_cap(staged + "_c2") == 2
    assert cuda.staged_bytes(8, 7168, 2) == 28704 and cuda.staged_bytes(1, 7168, 2) == 14352
    assert cuda._stage_launch(staged + "_c2", 8, 7168, cuda.STAGED_SHARED_LIMIT) == (28704, staged + "_c2")
    assert cuda._stage_launch(staged + "_c2", 8, 7168, 20000) == (0, "r8b1k1x1_r4b1k1x1")
    assert cuda.kernel_name(32, 13, staged + "_c2") == "moe_decode_b32_w13_r8b1k1x2_r4b1k1x2"
    assert cuda.kernel_name(16, 2, staged + "_s3_c4") == "moe_decode_b16_w2_r8b1k1x2_r4b1k1x2_s"
    assert cuda.streamed(staged + "_s3_c4") == 3 and cuda.streamed(staged + "_s_c4") == 0
    assert cuda.streamed(staged + "_c4") is None and cuda.rows_per_cta(staged + "_c4") == cuda.rows_per_cta(staged)
    for cap in (0, 9):
        with pytest.raises(ValueError, match=rf"tuning r8b1k1x2_r4b1k1x2_c{cap}: a staged pass holds 1 to 8 rows"):
            cuda.pass_cap(f"{staged}_c{cap}")


def test_streamed_stages_take_enough_row_blocks_a_warp_to_fill_one_wave() -> None:
    """A tuning ending "_s" streams each warp's row blocks one after another; the host gives each warp the fewest that
    fit the stage's grid in one wave of the blocks the SMs hold (the driver's occupancy answer, cuda.resident_blocks:
    four an SM, three where four blocks' staged rows pass its shared memory), or the count "_s<N>" names; one entry
    point serves every count. Grids worked out by hand on 132 SMs, 64 rows a block (four warps, a row block each):
    DeepSeek-V4-Flash T = 4 (24 pairs, 4,096 rows: 64 groups), Kimi-K2 T = 1 and 4 (8 and 32 pairs; w13 4,096 rows,
    w2 7,168: 112 groups). A stage whose K / 128 is not a multiple of each half's ring is refused before any launch,
    naming the tuning and K."""
    pytest.importorskip("triton")
    from moet.kernels import cuda
    from moet.kernels.layout import gpu_layer

    assert cuda.streamed(cuda.STAGED_TUNING) is None and cuda.streamed(cuda.WIDE_TUNING) is None
    assert cuda.streamed("r8b1k1x2_r4b1k1x2_s") == 0 and cuda.streamed("r8b1k1x2_r4b1k1x2_s3") == 3
    assert cuda.kernel_name(32, 13, "r8b1k1x2_r4b1k1x2_s3") == cuda.kernel_name(32, 13, "r8b1k1x2_r4b1k1x2_s")
    assert cuda.kernel_name(32, 13, "r8b1k1x2_r4b1k1x2_s") == "moe_decode_b32_w13_r8b1k1x2_r4b1k1x2_s"
    assert cuda.rows_per_cta("r8b1k1x2_r4b1k1x2_s") == cuda.rows_per_cta(cuda.STAGED_TUNING) == 64
    assert cuda.stream_rows(0, 24, 64, 4 * 132) == 3  # 24 × ceil(64 / 3) = 528 = 4 × 132; 2 rows: 768
    assert cuda.stream_rows(0, 8, 112, 4 * 132) == 2  # 8 × 56 = 448 ≤ 528; 1 row: 896
    assert cuda.stream_rows(0, 8, 64, 4 * 132) == 1  # 8 × 64 = 512: one wave already
    # three blocks an SM (four blocks' staged rows pass its shared memory): 396; 5 rows: 32 × 13 = 416, 6: 32 × 11 = 352
    assert cuda.stream_rows(0, 32, 64, 3 * 132) == 6
    assert cuda.stream_rows(5, 32, 64, 3 * 132) == 5
    assert cuda.stream_rows(0, 600, 64, 4 * 132) == 64  # more pairs than slots: a block a pair, its warps take all rows
    w13, w2, _ = gpu_layer(random_stored(2, 512, 640, "mx32", seed=5), random_stored(2, 640, 256, "mx32", seed=6),
                           torch.device("cpu"), fp4=False)
    x, weights, ids = torch.randn(1, 640).to(torch.bfloat16), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32)
    act, pair_out = torch.empty(1, 256, dtype=torch.bfloat16), torch.empty(1, 640)
    with pytest.raises(ValueError, match=r"r8b1k1x2_r4b1k1x2_s streams .* multiple of each ring \(w13 K 640\)"):
        cuda.decode_gemms(x, weights, ids, w13, w2, None, act, pair_out, ("r8b1k1x2_r4b1k1x2_s",) * 2)


def test_decode_sweep_times_each_stage_beside_the_other_stages_pick() -> None:
    """`moet bench kernels --sweep` at T ≤ 8: every built tuning for both stages, then each for one stage beside the
    other's pick (Kimi-K2 at T = 5 picks the staged tuning capped at 3 rows for w13, no built tuning of its own, and the
    streamed staged tuning for w2), each pair once and the picks themselves not again (they are the bench's `_gemms`
    row)."""
    from moet.bench.kernels import _candidates
    from moet.kernels import cuda
    from moet.kernels.moe import default_configs

    picks = default_configs(5, 7168, 2048, "cuda", 8, 132)
    pairs = [(a.tuning, b.tuning) for a, b in _candidates(5, 7168, 2048, "cuda", picks=picks)]
    capped = cuda.STAGED_TUNING + "_c3"
    pick = (capped, cuda.STREAMED_TUNING)
    assert (picks[0].tuning, picks[1].tuning) == pick
    n = len(cuda.TUNINGS)
    assert len(pairs) == len(set(pairs)) == n + 2 * (n - 1)  # each stage list less one pair: the same-pair, the picks
    assert pairs[:n] == [(t, t) for t in cuda.TUNINGS]
    assert {(t, cuda.STREAMED_TUNING) for t in cuda.TUNINGS} - {(cuda.STREAMED_TUNING,) * 2} <= set(pairs)
    assert {(capped, t) for t in cuda.TUNINGS} - {pick} <= set(pairs)
    assert pick not in pairs


def test_decode_bench_moves_each_layers_experts_onto_experts_of_its_own() -> None:
    """`moet bench kernels` routes each decode layer over all experts, then renames its distinct experts to the next
    unused entries of a permutation: the layers share no expert, a layer's tokens share the ones they shared (token
    0 and 1 both name expert 7 below, so both name perm[2]), and layers that name more distinct experts than there are
    keep their routing (None)."""
    from moet.bench.kernels import disjoint_experts

    perm = torch.tensor([5, 9, 0, 3, 8, 1, 2, 4, 6, 7])
    first = torch.tensor([[7, 2], [7, 4]], dtype=torch.int32)  # distinct 2, 4, 7 → perm[0], perm[1], perm[2]
    second = torch.tensor([[2, 6], [1, 6]], dtype=torch.int32)  # distinct 1, 2, 6 → perm[3], perm[4], perm[5]
    renamed = disjoint_experts([first, second], perm)
    assert [r.tolist() for r in renamed] == [[[0, 5], [0, 9]], [[8, 1], [3, 1]]]
    assert all(r.dtype == torch.int32 for r in renamed)
    assert disjoint_experts([first, second, torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)], perm) is None
