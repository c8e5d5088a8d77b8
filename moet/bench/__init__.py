"""Benchmarks: one module per `moet bench NAME`, each with `add_arguments(parser)` and `run(args) -> int`.

Modules import heavy dependencies inside `run` so that `moet --help` stays fast.
"""
