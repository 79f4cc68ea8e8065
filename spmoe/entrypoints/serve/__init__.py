"""`spmoe serve`: the OpenAI-compatible server."""
