"""moet.eval.perplexity on a tiny random Qwen3-MoE: experts swap in exactly, variants differ, windows are well placed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moet.eval.perplexity import expert_weights, heldout_windows, load_model, score  # noqa: E402
from moet.formats.source import ExpertKey  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(out)
    return out


def test_source_experts_reproduce_the_checkpoint(tiny: Path) -> None:
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ref.config._experts_implementation = "eager"
    model = load_model(tiny)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_base_variant_changes_experts_only(tiny: Path) -> None:
    source = expert_weights(tiny, "source")
    base = expert_weights(tiny, "base")
    assert source.keys() == base.keys() and len(source) == 2 * 4 * 3
    key = ExpertKey(1, 3, "down")
    assert source[key].shape == base[key].shape == (64, 32)
    rel = (base[key] - source[key]).norm() / source[key].norm()
    assert 0.05 < rel < 0.6
    windows = heldout_windows(torch.arange(1000) % 128, n_tokens=64, seq_len=16)
    s_src, s_base = score(load_model(tiny, source), windows), score(load_model(tiny, base), windows)
    assert s_src.logprobs.shape == (4, 16) and torch.isfinite(s_src.logprobs).all()
    assert s_src.perplexity != s_base.perplexity


def test_missing_expert_is_an_error(tiny: Path) -> None:
    experts = expert_weights(tiny, "source")
    del experts[ExpertKey(0, 0, "gate")]
    with pytest.raises(KeyError, match="missing"):
        load_model(tiny, experts)


def test_windows_are_disjoint_and_spread() -> None:
    ids = torch.arange(10_000)
    w = heldout_windows(ids, n_tokens=512, seq_len=64)
    assert w.shape == (8, 65)
    starts = w[:, 0]
    assert (starts[1:] - starts[:-1] >= 65).all() and int(starts[-1]) > 8000
