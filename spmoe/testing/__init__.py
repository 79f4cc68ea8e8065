"""What the tests and the benchmarks share and the server never runs: the demo checkpoint's held-out
text and its perplexity."""
