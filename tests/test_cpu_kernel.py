"""The C++ CPU MoE kernel (moet/kernels/cpu_src) against float64 references, on every ISA this CPU runs.

Hand-written bit patterns for a tiny layer, every scale byte of both scale kinds decoded against the
formats' definitions (by the row kernels and by the bf16 prefill panels), and whole layers (decode
passes, the prefill GEMM, masked row tails, missing experts, strided experts, each activation, in
float32 and bf16) against moet.testing.reference.moe_reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from moet.kernels import cpu_build
from moet.kernels.cpu import kernel_forward, moe_forward
from moet.kernels.oracle import MoeBackend, select_moe_backend
from moet.testing.reference import moe_reference
from moet.testing.random_stacked import random_stored
from moet.quant.codebook import Tier
from moet.quant.scales import SCALE_BLOCK
from moet.quant.stacked import StackedWeight

pytestmark = pytest.mark.skipif(not cpu_build.load(), reason="CPU MoE kernel not built (install.sh says why)")
TOLERANCE = 1e-5  # relative L2, as tests/test_cpu_moe.py


def _isas() -> list[str]:
    if not cpu_build.load():
        return []
    available = []
    for isa in ("avx512bf16", "avx512", "avx2", "scalar"):
        try:
            torch.ops.moet_cpu.isa(isa)
            available.append(isa)
        except RuntimeError:
            pass
    return available


ISAS = _isas()
BF16_ISAS = [isa for isa in ISAS if isa == "avx512bf16"]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(torch.linalg.norm(got.double() - want) / torch.linalg.norm(want))


def test_tiny_layer_from_hand_written_bits() -> None:
    """One expert, H = I = 32, nv16: codes, e4m3 bytes and row scales written out, the answer computed
    here from the values they stand for."""
    pattern = 0b11_10_01_00  # k = 4i..4i+3 → codes 0, 1, 2, 3 → −4, −1, +1, +4
    flipped = 0b00_01_10_11  # → +4, +1, −1, −4
    codes13 = torch.tensor([[pattern if n % 2 else flipped] * 8 for n in range(64)], dtype=torch.uint8)
    codes2 = torch.tensor([[pattern] * 8 for _ in range(32)], dtype=torch.uint8)
    # e4m3: 0x38 = 1.0, 0x40 = 2.0, 0x30 = 0.5, 0x01 = 2^-9 (subnormal), 0xB8 = −1.0
    scales13 = torch.tensor([[0x38, 0x40] if n % 3 else [0x30, 0xB8] for n in range(64)], dtype=torch.uint8)
    scales2 = torch.tensor([[0x01, 0x38]] * 32, dtype=torch.uint8)
    row13 = torch.tensor([0.25 + n / 64 for n in range(64)])
    row2 = torch.full((32,), 0.5)
    w13 = StackedWeight(codes13[None], scales13[None], row13[None], "nv16")
    w2 = StackedWeight(codes2[None], scales2[None], row2[None], "nv16")
    x = [math.sin(k) for k in range(32)]
    value = {0x38: 1.0, 0x40: 2.0, 0x30: 0.5, 0x01: 2.0**-9, 0xB8: -1.0}

    def row(codes: list[int], scales: list[int], r: float, inputs: list[float]) -> float:
        weights = [(-4.0, -1.0, 1.0, 4.0)[(codes[k // 4] >> (2 * (k % 4))) & 3] * value[scales[k // 16]] * r for k in range(32)]
        return sum(w * v for w, v in zip(weights, inputs))

    gate_up = [row(codes13[n].tolist(), scales13[n].tolist(), float(row13[n]), x) for n in range(64)]
    hidden = [g / (1 + math.exp(-g)) * u for g, u in zip(gate_up[:32], gate_up[32:])]
    want = torch.tensor([[0.75 * row(codes2[n].tolist(), scales2[n].tolist(), 0.5, hidden) for n in range(32)]], dtype=torch.float64)
    for isa in ISAS:
        got = kernel_forward(torch.tensor([x]), torch.tensor([[0.75]]), torch.tensor([[0]], dtype=torch.int32), w13, w2, isa=isa)
        assert _rel(got, want) < TOLERANCE, isa


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["nv16", "mx32"])
def test_every_scale_byte_decodes_exactly(isa: str, kind: str) -> None:
    """The kernel's decode (codes × block scale × row scale in float32) equals the float64 definition
    rounded once, for all 256 scale bytes except the NaN patterns."""
    nan = (0x7F, 0xFF) if kind == "nv16" else (0xFF,)
    block = SCALE_BLOCK[kind]
    scale_bytes = torch.tensor([b for b in range(256) if b not in nan], dtype=torch.uint8)
    rows = scale_bytes.numel()
    gen = torch.Generator().manual_seed(1)
    cols = 4 * block
    codes = torch.randint(0, 256, (1, rows, cols // 4), dtype=torch.uint8, generator=gen)
    scales = torch.stack([scale_bytes.roll(s) for s in range(cols // block)], dim=-1)[None]
    row_scale = (torch.rand(1, rows, generator=gen) + 0.5) if kind == "nv16" else torch.ones(1, rows)
    w = StackedWeight(codes, scales.contiguous(), row_scale, kind)
    got = torch.ops.moet_cpu.decode(w.codes, w.scales, w.row_scale, block, isa)
    want = w.dequantize(0, Tier.NONE).to(torch.float32)
    assert torch.equal(got[0], want)


@pytest.mark.skipif(not BF16_ISAS, reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("kind", ["nv16", "mx32"])
def test_every_scale_byte_decodes_exactly_into_bf16_panels(kind: str) -> None:
    """The prefill panels hold code × block scale in bf16 (exact), the row scale applied in float32
    afterwards: the float64 definition rounded once, for every scale byte but two UE8M0 ends: 2^-127
    (subnormal in bf16) is flushed to zero, 2^127 (× 4 overflows) is outside the panels' range."""
    nan = (0x7F, 0xFF) if kind == "nv16" else (0xFF, 0xFE)
    block = SCALE_BLOCK[kind]
    scale_bytes = torch.tensor([b for b in range(256) if b not in nan], dtype=torch.uint8)
    rows = scale_bytes.numel()
    gen = torch.Generator().manual_seed(1)
    cols = 4 * block
    codes = torch.randint(0, 256, (1, rows, cols // 4), dtype=torch.uint8, generator=gen)
    scales = torch.stack([scale_bytes.roll(s) for s in range(cols // block)], dim=-1)[None].contiguous()
    row_scale = (torch.rand(1, rows, generator=gen) + 0.5) if kind == "nv16" else torch.ones(1, rows)
    w = StackedWeight(codes, scales, row_scale, kind)
    got = torch.ops.moet_cpu.decode_bf16(w.codes, w.scales, w.row_scale, block)[0]
    want = w.dequantize(0, Tier.NONE).to(torch.float32)
    if kind == "mx32":
        flushed = (scales[0] == 0).repeat_interleave(block, dim=-1)
        assert torch.equal(got[flushed], torch.zeros(int(flushed.sum())))
        want[flushed] = 0.0
    assert torch.equal(got, want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["nv16", "mx32"])
@pytest.mark.parametrize("shape", [(64, 32), (160, 96)])  # (H, I): 160/96 leave masked lanes in a row's last group
@pytest.mark.parametrize("tokens", [1, 3, 64])  # 64 tokens over 6 experts: ≥ 16 per expert, the GEMM pass
def test_kernel_equals_float64_reference(isa: str, kind: str, shape: tuple[int, int], tokens: int) -> None:
    hidden, inter = shape
    experts, k = 6, 2
    gen = torch.Generator().manual_seed(tokens + hidden)
    w13 = random_stored(experts, 2 * inter, hidden, kind, seed=tokens, refine=False)
    w2 = random_stored(experts, hidden, inter, kind, seed=tokens + 1, refine=False)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, k, generator=gen)
    got = kernel_forward(x, weights, ids, w13, w2, isa=isa)
    assert got.dtype == torch.float32
    assert _rel(got, moe_reference(x, weights, ids, w13, w2)) < TOLERANCE


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["nv16", "mx32"])
@pytest.mark.parametrize("shape", [(64, 32), (160, 96), (352, 64)])  # 160, 352: a last row block of 32 half or wholly past H
@pytest.mark.parametrize("tokens", [2, 5, 64, 300])  # over 6 experts: row passes, panels (≥ 6 an expert), panels split in tasks
def test_bf16_activations(isa: str, kind: str, shape: tuple[int, int], tokens: int) -> None:
    """bf16 x (the served dtype): float32 row passes and a oneDNN bf16 GEMM, or with AVX512-BF16 the bf16
    row kernel and panels (hidden activations rounded to bf16 like vLLM's BF16 experts); all within
    bf16's rounding of the float64 answer."""
    hidden, inter = shape
    w13 = random_stored(6, 2 * inter, hidden, kind, seed=11, refine=False)
    w2 = random_stored(6, hidden, inter, kind, seed=12, refine=False)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, 2, generator=gen)
    got = kernel_forward(x, weights, ids, w13, w2, isa=isa)
    assert got.dtype == torch.bfloat16
    assert _rel(got, moe_reference(x, weights, ids, w13, w2)) < 1e-2


@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize("tokens", [3, 200])
def test_bf16_paths_do_not_depend_on_grouping(isa: str, tokens: int) -> None:
    """A token's output through the bf16 paths is the same bits whether it comes alone or among others
    taking the same path (tiles of 12, tasks split over threads)."""
    w13 = random_stored(4, 128, 256, "nv16", seed=21, refine=False)
    w2 = random_stored(4, 256, 64, "nv16", seed=22, refine=False)
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, 2, generator=gen)
    full = kernel_forward(x, weights, ids, w13, w2, isa=isa)
    order = torch.randperm(tokens, generator=gen)
    assert torch.equal(kernel_forward(x[order], weights[order], ids[order], w13, w2, isa=isa), full[order])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_kernel_activations(isa: str, activation: str) -> None:
    w13 = random_stored(4, 64, 64, "nv16", seed=3, refine=False)
    w2 = random_stored(4, 64, 32, "nv16", seed=4, refine=False)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 64, generator=gen)
    ids = torch.randint(0, 4, (5, 2), generator=gen, dtype=torch.int32)
    weights = torch.rand(5, 2, generator=gen)
    got = kernel_forward(x, weights, ids, w13, w2, activation, isa=isa)
    assert _rel(got, moe_reference(x, weights, ids, w13, w2, activation=activation)) < TOLERANCE


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("repeat", [1, 16])  # 16: enough pairs for the prefill paths
def test_missing_experts_contribute_zero(isa: str, dtype: torch.dtype, repeat: int) -> None:
    """ids < 0 (not on this rank) and present[e] == False (a cache miss) weigh nothing; a token with no
    present expert gets exact zeros."""
    w13 = random_stored(4, 64, 64, "mx32", seed=6, refine=False)
    w2 = random_stored(4, 64, 32, "mx32", seed=7, refine=False)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3 * repeat, 64, generator=gen).to(dtype)
    ids = torch.tensor([[0, -1], [2, 1], [-1, 2]] * repeat, dtype=torch.int32)
    weights = torch.rand(3 * repeat, 2, generator=gen)
    present = torch.tensor([True, True, False, True])
    got = kernel_forward(x, weights, ids, w13, w2, present=present, isa=isa)
    kept = weights * ((ids >= 0) & present[ids.clamp(min=0)])
    some = torch.tensor([t % 3 != 2 for t in range(3 * repeat)])
    tolerance = TOLERANCE if dtype == torch.float32 else 1e-2
    assert _rel(got[some], moe_reference(x, kept, ids.clamp(min=0), w13, w2)[some]) < tolerance
    assert torch.equal(got[~some], torch.zeros(int((~some).sum()), 64, dtype=dtype))


def test_moe_forward_takes_the_kernel_for_the_base_only() -> None:
    """The oracle sends a CPU call to the kernel unless an expert is at the FP4 tier; it returns x's dtype."""
    w13 = random_stored(4, 64, 64, "nv16", seed=9)
    w2 = random_stored(4, 64, 32, "nv16", seed=10)
    cpu = torch.device("cpu")
    assert select_moe_backend(cpu, 2) == select_moe_backend(cpu, 2, torch.zeros(4, dtype=torch.bool)) == MoeBackend.CPU_KERNEL
    assert select_moe_backend(cpu, 2, torch.tensor([False, True, False, False])) == MoeBackend.CPU_TORCH
    x = torch.randn(2, 64).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    out = moe_forward(x, torch.ones(2, 2), ids, w13, w2, backend=select_moe_backend(cpu, 2))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, kernel_forward(x, torch.ones(2, 2), ids, w13, w2).to(torch.bfloat16))


def test_strided_experts_are_read_in_place() -> None:
    """The device cache hands the op its experts as strided views of its slot buffer (dense rows within an
    expert, a pack row between experts); the kernel reads them in place and gives the float64 answer."""
    w13 = random_stored(4, 64, 64, "nv16", seed=11)
    w2 = random_stored(4, 64, 32, "nv16", seed=12)

    def strided(w: StackedWeight) -> StackedWeight:
        """The same weights, each field every other expert of a buffer twice as long."""
        fields = []
        for t in (w.codes, w.scales, w.row_scale):
            buffer = torch.zeros(2 * t.shape[0], *t.shape[1:], dtype=t.dtype)
            buffer[::2] = t
            fields.append(buffer[::2])
        return StackedWeight(*fields, w.scale_kind)

    s13, s2 = strided(w13), strided(w2)
    assert not s13.codes.is_contiguous() and select_moe_backend(torch.device("cpu"), 24) == MoeBackend.CPU_KERNEL
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]] * 8, dtype=torch.int32)  # 12 pairs an expert: the bf16 panels too
    weights = torch.rand(24, 2)
    for dtype, tolerance in ((torch.float32, TOLERANCE), (torch.bfloat16, 1e-2)):
        x = torch.randn(24, 64).to(dtype)
        for isa in ISAS:
            got = kernel_forward(x, weights, ids, s13, s2, isa=isa)
            assert _rel(got, moe_reference(x, weights, ids, w13, w2)) < tolerance, isa
            assert torch.equal(got, kernel_forward(x, weights, ids, w13, w2, isa=isa)), isa
