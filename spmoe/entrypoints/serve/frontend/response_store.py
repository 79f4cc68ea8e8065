"""Responses made with `store`, kept for `previous_response_id` and `GET /v1/responses/{id}`: the
most recent MAX_STORED_RESPONSES of a server, in one SQLite database (WAL mode, so that readers
never wait on the writer) that every front end of the server opens.

Rank 0 makes the database's folder (mode 0700) before the first front end starts and removes it
when the server stops (`engine/front_ends.py`): a response stored through one front end is found
through any other, and through one that replaced a front end that died. Each entry is the
conversation through the response (chat messages) and the response, both as JSON text: nothing of
them stays in the front end's memory.

The database is the server's scratch space, removed at exit: it is written without fsync
(`synchronous = OFF`; a machine that crashes loses the server anyway). Puts and gets run in a
thread of the store's own, one at a time, off the event loop: a put takes some 50 us, but one that
waits for another front end's can take far longer (up to 1.2 s against a process putting as fast
as it can: `benchmarks/bench_response_store.py --latency`), and the event loop must not wait.
"""

import asyncio
import fcntl
import json
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor

from spmoe.entrypoints.serve.frontend.protocol import ApiError

RESPONSES_DATABASE = "responses.sqlite"  # its file, in the front ends' shared folder
MAX_STORED_RESPONSES = 1024  # the most recent responses kept, of all front ends together
BUSY_TIMEOUT_MS = 5000  # how long a put waits for another front end's put
# the connection's page cache (SQLite's default: 2000 KiB), which fills as the database grows: the
# file's pages are in the kernel's cache anyway, outside the front end's RSS
CACHE_KIB = 256
SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    conversation TEXT NOT NULL,
    response TEXT NOT NULL
)"""


class ResponseStore:
    """The stored responses in the database at `path` (":memory:": this process's own, for an app
    served in one process): id -> (the conversation through the response, the response)."""

    def __init__(self, path: str = ":memory:", capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        # the one thread that uses the connection, a call at a time (the connection is made in
        # this thread: hence check_same_thread off)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        # autocommit (isolation_level None): each put is one explicit transaction
        self.db = sqlite3.connect(
            path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )
        self.db.execute("PRAGMA synchronous = OFF")
        self.db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
        # the front ends start at once: the database's set-up one at a time (switching it to WAL
        # while another connection does may fail at once with "database is locked")
        with open(f"{path}.lock" if path != ":memory:" else os.devnull, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.db.execute("PRAGMA journal_mode = WAL")
            self.db.execute(SCHEMA)

    async def put(self, response: dict, conversation: list[dict]) -> None:
        """Keep `response` (its "id" the key) and `conversation` (the chat messages through it);
        the oldest beyond `capacity` go."""
        await asyncio.get_running_loop().run_in_executor(
            self.thread, self.put_now, response, conversation
        )

    async def get(self, response_id: str, param: str | None = None) -> tuple[list[dict], dict]:
        """-> (the conversation through the response, the response); ApiError (400 naming `param`
        when given, else 404) for an id not stored."""
        return await asyncio.get_running_loop().run_in_executor(
            self.thread, self.get_now, response_id, param
        )

    def put_now(self, response: dict, conversation: list[dict]) -> None:
        """`put`, in the calling thread (the store's own)."""
        row = (response["id"], json.dumps(conversation), json.dumps(response))
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute(
                "INSERT OR REPLACE INTO responses (id, conversation, response) VALUES (?, ?, ?)",
                row,
            )
            self.db.execute(
                "DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?",
                (self.capacity,),
            )
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def get_now(self, response_id: str, param: str | None = None) -> tuple[list[dict], dict]:
        """`get`, in the calling thread (the store's own)."""
        row = self.db.execute(
            "SELECT conversation, response FROM responses WHERE id = ?", (response_id,)
        ).fetchone()
        if row is None:
            why = (
                f"no stored response has the id {response_id!r}: it was made with store false, "
                f"by another server, or is older than the {self.capacity} most recent"
            )
            raise ApiError(400 if param else 404, why, param)
        return json.loads(row[0]), json.loads(row[1])
