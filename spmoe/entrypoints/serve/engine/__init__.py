"""The rank side of `spmoe serve`: what every rank runs (`rank.py`), rank 0's engine loop
(`loop.py`) and the front end processes it starts and watches (`front_ends.py`). It imports no
HTTP framework (FastAPI, Starlette, uvicorn); it talks to the front ends over the wire
(`serve/wire.py`)."""
