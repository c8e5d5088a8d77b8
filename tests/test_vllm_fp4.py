"""The FP4 pool and the confidence gate inside real vLLM, on the embedded default model."""

from __future__ import annotations


import pytest

from moet.models import DEFAULT_MODEL_DIR
from moet.quant.codebook import Tier
from tests.test_vllm_plugin import PROMPTS, _compare, reference_log_probs, run_vllm, selected, start_vllm

pytestmark = pytest.mark.vllm
CODE_PROMPT = ["def main(argv):\n    parser ="]
# The default model's FP4 tier (refinement) is 60 KiB per expert, 192 experts: 11.25 MiB.
ALL_EXPERTS_GB = "0.012"
MOST_EXPERTS_GB = "0.0086"  # 150 of 192: more than one step routes to, fewer than all
SPEC = {"model": str(DEFAULT_MODEL_DIR), "prompts": CODE_PROMPT, "dtype": "float32", "max_tokens": 12}
ALL_FP4 = {"VLLM_MOE_W2": "1", "VLLM_MOE_W2_DELTA_GB": ALL_EXPERTS_GB}
GATED = {"VLLM_MOE_W2": "1", "VLLM_MOE_W2_DELTA_GB": MOST_EXPERTS_GB, "VLLM_MOE_W2_GATE": "1", "VLLM_MOE_W2_GATE_TAU": "1.0"}
BASE = {"VLLM_MOE_W2": "1"}


@pytest.fixture(scope="module", autouse=True)
def _runs_ahead(request: pytest.FixtureRequest, checkpoint) -> None:
    """Start the selected tests' vLLM runs, two at a time (tests/test_vllm_plugin.py `start_vllm`)."""
    for item in selected(request):
        if item.originalname == "test_gate_at_tau_1_equals_the_all_fp4_path_bit_for_bit":
            for env in (ALL_FP4, GATED, BASE):
                start_vllm(SPEC, **env)
        elif item.originalname == "test_all_fp4_pool_equals_float64_reference_of_the_source_nibbles":
            quant = checkpoint("qwen3_moe", "nvfp4")
            start_vllm({"model": str(quant), "prompts": PROMPTS, "dtype": "float32"}, VLLM_MOE_W2="1", VLLM_MOE_W2_DELTA_GB="1")


def test_gate_at_tau_1_equals_the_all_fp4_path_bit_for_bit() -> None:
    """A pool holding every expert runs the FP4 tier everywhere; a smaller pool with the gate at
    τ = 1 re-runs every step with its experts promoted until the fixed point. Tokens, log-probs and
    prompt log-probs must be identical to the last bit."""
    all_fp4, gated, base = (start_vllm(SPEC, **env) for env in (ALL_FP4, GATED, BASE))
    all_fp4, gated, base = all_fp4.result(), gated.result(), base.result()
    assert gated == all_fp4
    assert base[0]["logprobs"] != all_fp4[0]["logprobs"]  # the FP4 tier really changed the experts


def test_all_fp4_pool_equals_float64_reference_of_the_source_nibbles(checkpoint) -> None:
    """Every expert promoted: vLLM's logits are the checkpoint's own FP4 experts (float64 reference,
    transformers' model code), within 2e-3 in log-prob."""
    bf16 = checkpoint("qwen3_moe", "bf16")
    quant = checkpoint("qwen3_moe", "nvfp4")
    results = run_vllm({"model": str(quant), "prompts": PROMPTS, "dtype": "float32"}, VLLM_MOE_W2="1", VLLM_MOE_W2_DELTA_GB="1")
    for result in results:
        reference = reference_log_probs(bf16, quant, result["prompt_ids"] + result["tokens"], tier=Tier.PLANES)
        assert float(_compare(result, reference).max()) < 2e-3
