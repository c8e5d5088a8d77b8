"""Fixtures the tests and the benchmarks share, kept out of the serving path: random stacked experts,
the float64 and bf16 MoE references, and a synthetic Zipf-routed MoE for the tier tests."""
