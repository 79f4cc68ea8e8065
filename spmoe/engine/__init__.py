"""The serving engine: requests, the scheduler, the model runner, the KV cache, sampling and MTP
speculation."""
