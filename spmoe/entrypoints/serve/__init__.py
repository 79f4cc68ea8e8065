"""`spmoe serve`: the OpenAI-compatible server, one folder per process. `server.py` is the command:
it checks the options and starts every rank. `engine/` is the rank side (every rank's `serve_rank`,
rank 0's engine loop and the front end processes it starts); `frontend/` is a front end process (the
HTTP app, request reading, the tokenizer, rendering, metrics). `wire.py` is what passes between
them."""
