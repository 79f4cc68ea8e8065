"""`spmoe serve`: the OpenAI-compatible server. `ranks.py` runs the engine on every rank."""
