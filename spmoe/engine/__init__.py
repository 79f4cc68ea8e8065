"""Generation on top of the model: KV cache, sampling, the step loop and MTP speculation."""
