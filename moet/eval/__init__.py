"""Quality evaluation: held-out perplexity of checkpoints with swapped routed experts (moet.eval.perplexity)."""
