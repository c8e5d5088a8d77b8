"""The out-of-tree vLLM plugin: a quantization config that claims routed experts, and its MoE method.

Importing this package does not import vLLM; `moet.vllm.plugin.register` (the entry point) does.
"""
