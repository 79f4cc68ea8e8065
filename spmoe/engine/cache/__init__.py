"""The KV cache: one slot per sequence, or paged blocks with the prefix cache's hash chain."""
