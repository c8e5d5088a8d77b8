"""`moet bench e2e`'s choice of frontier layers: what fits a GPU's memory (the bench itself needs a GPU)."""

import pytest

from moet.bench.e2e import frontier_layers

# The device tool's cards' total memory (torch.cuda.get_device_properties); the bench passes what is free, ~0.5 GiB
# less beside the CUDA context, which picks the same counts.
H100 = 81559 * 2**20  # H100 80GB HBM3
H200 = 143771 * 2**20


def test_layers_fit_the_gpu():
    # DeepSeek-V4-Flash: 256 experts of 3·4096·2048 weights, bf16 12.9 GB a layer; 3 fit an H100 "twice", 5 an H200.
    assert frontier_layers("deepseek-v4-flash", H100) == 3
    assert frontier_layers("deepseek-v4-flash", H200) == 5
    # Kimi-K2: 384 experts of 3·7168·2048, bf16 33.8 GB a layer: two are 67.6 GB of bf16 alone plus 2 × 13 GB of
    # 2-bit/FP4 stacks, more than an H100 holds (the bench ran out of memory there with two on 2026-12-06).
    assert frontier_layers("kimi-k2", H100) == 1
    assert frontier_layers("kimi-k2", H200) == 2
    assert frontier_layers("kimi-k2", H100, asked=1) == 1
    assert frontier_layers("deepseek-v4-flash", H100 - 2**29) == 3
    assert frontier_layers("deepseek-v4-flash", H200 - 2**29) == 5


@pytest.mark.parametrize(
    "name, gpu, asked, message",
    [
        ("kimi-k2", H100, 2, "kimi-k2: 2 layers need about 117 GiB of GPU memory, this GPU has 80 GiB free: use --layers 1 (at most 1 fit)"),
        ("kimi-k2", 24 * 2**30, 0, "kimi-k2: 1 layer needs about 63 GiB of GPU memory, this GPU has 24 GiB free: it needs a GPU with more memory"),
        ("llama", H100, 0, "unknown model 'llama': the frontier models are deepseek-v4-flash, kimi-k2, and embedded"),
        ("deepseek-v4-flash", H100, -1, "--layers -1: give a positive count, or 0 for as many as fit"),
    ],
)
def test_what_does_not_fit_is_refused_with_the_fix(name, gpu, asked, message):
    with pytest.raises(ValueError) as err:
        frontier_layers(name, gpu, asked)
    assert str(err.value) == message
