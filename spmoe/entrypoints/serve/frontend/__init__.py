"""A front end process of `spmoe serve`: HTTP, request reading, the tokenizer, templates, parsers,
rendering and metrics. It imports nothing of torch, nor of the engine beyond its records
(`spmoe.engine.request`), nor of the model; it talks to rank 0's engine process over the wire
(`serve/wire.py`)."""
