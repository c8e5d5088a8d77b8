"""Entry point of the `vllm.general_plugins` group: registers the `moet` quantization config.

vLLM calls this once in every process (API server, engine core, workers); it is idempotent.
"""

from __future__ import annotations

import os


def register() -> None:
    from vllm import envs
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    from moet.knobs import Knobs
    from moet.vllm import step_hook
    from moet.vllm.config import MoetConfig

    knobs = Knobs.from_env()  # malformed or unknown VLLM_MOE_W2* knobs fail at start-up, in every process
    # vLLM warns about every VLLM_* variable it does not know (plugins load before that check), which
    # reads as misconfiguration: moet's knobs become known variables of vLLM's.
    for name in Knobs.env_names():
        envs.environment_variables.setdefault(name, lambda name=name: os.environ.get(name))
    if MoetConfig.get_name() not in QUANTIZATION_METHODS:
        register_quantization_config(MoetConfig.get_name())(MoetConfig)
    if knobs.w2:
        step_hook.install()
