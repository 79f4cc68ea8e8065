"""The forward on the model, eager or replayed from CUDA graphs, the choice of tokens,
the drafter."""
