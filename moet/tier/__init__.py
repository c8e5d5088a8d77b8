"""Runtime FP4 tier: the pool of FP4 expert slots (pool) and the confidence gate (gate)."""
