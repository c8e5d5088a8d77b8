"""The one hook into vLLM's step: wrappers around the loaded model's `forward` and `compute_logits`.

vLLM's model runner calls `model(...)` inside its forward context, then `model.compute_logits` on
the rows it samples. Wrapping those two methods of the model instance (installed by patching the
model loader's `load_model`, no fork) gives what the tiers and the gate need:

* replay (VLLM_MOE_W2_BASE_CACHE_GB): the forward runs under the ReplayDriver, which fetches the
  experts a pass missed and runs the pass again until none is missing (bit-identical output);
* the FP4 pool and the confidence gate (VLLM_MOE_W2_DELTA_GB, VLLM_MOE_W2_GATE=1): after the
  logits of a step, the gate may promote the step's routed experts to FP4 and re-run the same
  forward under the saved forward context, then recompute the logits, to a fixed point; the pool
  then commits its frequency-driven promotions between steps. A re-run rewrites the step's own KV
  entries, which is exactly what the final pass must leave behind. The rows vLLM samples are the
  last token of each request; a step whose sampled rows cannot be matched is not gated.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("moet")


class StepHook:
    """State of the current step, shared by the two wrappers of one model instance."""

    def __init__(self, model: torch.nn.Module, replay: Any | None, fp4: Any | None) -> None:
        self.forward = model.forward
        self.compute_logits = model.compute_logits
        self.replay = replay
        self.fp4 = fp4
        self.saved: tuple[tuple, dict, Any, torch.Tensor | None] | None = None

    def _forward(self, args: tuple, kwargs: dict, decode: bool) -> Any:
        def one_pass() -> Any:
            if self.fp4 is not None:
                self.fp4.begin_pass()
            return self.forward(*args, **kwargs)

        return self.replay.run(one_pass, decode=decode) if self.replay is not None else one_pass()

    def wrapped_forward(self, *args: Any, **kwargs: Any) -> Any:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        context = get_forward_context() if is_forward_context_available() else None
        out = self._forward(args, kwargs, _is_decode(context))
        self.saved = (args, kwargs, context, out) if self.fp4 is not None else None
        return out

    def wrapped_compute_logits(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        logits = self.compute_logits(hidden, *args, **kwargs)
        if self.fp4 is None or logits is None:
            return logits
        saved, self.saved = self.saved, None
        rows = None if saved is None else _sampled_rows(saved[2])
        if rows is None or rows.numel() != hidden.shape[0] or not torch.equal(saved[3][rows], hidden):
            return self.fp4.after_logits(logits, None)
        fwd_args, fwd_kwargs, context, first_out = saved

        def rerun() -> torch.Tensor:
            from vllm.forward_context import override_forward_context

            with override_forward_context(context):
                out = self._forward(fwd_args, fwd_kwargs, _is_decode(context))
            first_out.copy_(out)  # the runner still holds the first pass's tensor (prompt log-probs read it)
            return self.compute_logits(out[rows], *args, **kwargs)

        return self.fp4.after_logits(logits, rerun)


def _is_decode(context: Any) -> bool:
    """A step whose every request brings one token (what the arena's hot set protects)."""
    metadata = _metadata(context)
    return metadata is not None and getattr(metadata, "max_query_len", 0) == 1


def _sampled_rows(context: Any) -> torch.Tensor | None:
    """The hidden-state rows vLLM samples: the last token of each request (query_start_loc[1:] − 1)."""
    metadata = _metadata(context)
    start = getattr(metadata, "query_start_loc", None)
    return None if start is None else (start[1:] - 1).long()


def _metadata(context: Any) -> Any:
    metadata = getattr(context, "attn_metadata", None)
    if isinstance(metadata, dict):
        metadata = next(iter(metadata.values()), None)
    if isinstance(metadata, list):
        metadata = metadata[0] if metadata else None
    return metadata


def model_engine(model: torch.nn.Module) -> Any | None:
    """The engine state (moet.vllm.engine.MoetEngine) the model's MoE layers share, or None."""
    engines = {id(m.moet_engine): m.moet_engine for m in model.modules() if hasattr(m, "moet_engine")}
    if len(engines) > 1:
        raise RuntimeError("one model's MoE layers hold different engine states")
    return next(iter(engines.values()), None)


def attach(model: torch.nn.Module) -> torch.nn.Module:
    """Hang the model's engine state on a freshly loaded model (`model.moet_engine`), and install the
    step hook when its tiers or its gate need it."""
    engine = model_engine(model)
    if engine is None:
        return model
    model.moet_engine = engine
    replay, fp4 = engine.replay, engine.fp4
    if replay is None and fp4 is None:
        return model
    hook = StepHook(model, replay, fp4)
    model.forward = hook.wrapped_forward
    model.compute_logits = hook.wrapped_compute_logits
    model.moet_step_hook = hook
    logger.warning("moet: step hook installed (replay=%s, fp4 pool=%s)", replay is not None, fp4 is not None)
    return model


def install() -> None:
    """Patch vLLM's model loader once per process so every loaded model passes through `attach`; on a
    GPU also its graph capture, so that a delta_gb=auto pool is allocated first (`allocate_pool_first`)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if getattr(BaseModelLoader.load_model, "moet_hook", False):
        return
    original = BaseModelLoader.load_model

    def load_model(self: Any, vllm_config: Any, model_config: Any, prefix: str = "") -> torch.nn.Module:
        return attach(original(self, vllm_config, model_config, prefix=prefix))

    load_model.moet_hook = True  # type: ignore[attr-defined]
    BaseModelLoader.load_model = load_model  # type: ignore[method-assign]
    if torch.cuda.is_available():
        allocate_pool_first()


def allocate_pool_first() -> None:
    """VLLM_MOE_W2_DELTA_GB=auto sizes the FP4 pool from the GPU memory vLLM left free once its KV cache
    is allocated; the slots must exist before CUDA graphs are captured (the graphs hold their addresses).
    vLLM's GPU model runner allocates the KV cache, then `capture_model`: allocate the pool at its start.
    (Written against vLLM 0.32's GPUModelRunner; never run: no vLLM exists on the GPU this project has.)"""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.capture_model, "moet_hook", False):
        return
    original = GPUModelRunner.capture_model

    def capture_model(self: Any) -> int:
        engine = getattr(self.get_model(), "moet_engine", None)
        if engine is not None and engine.fp4 is not None:
            engine.fp4.allocate()
        return original(self)

    capture_model.moet_hook = True  # type: ignore[attr-defined]
    GPUModelRunner.capture_model = capture_model  # type: ignore[method-assign]
