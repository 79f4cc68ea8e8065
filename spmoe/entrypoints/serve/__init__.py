"""`spmoe serve`: the OpenAI-compatible server. `ranks.py` runs the engine on every rank; `server.py` starts
them and the HTTP front end (`app.py`: the routes, with `request_reader.py`, `rendering.py`, `protocol.py`,
`tokenizer.py`, `streaming.py`, `metrics.py`)."""
