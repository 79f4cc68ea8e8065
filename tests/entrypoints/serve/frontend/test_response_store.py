"""The stored responses' database (`ResponseStore`): what is put comes back as it was put, through
any connection to the file; the most recent `capacity` are kept, of all writers together; an id not
kept is a 404, or a 400 naming the field it came in; two processes that put at once lose nothing.
(Through real front ends: tests/entrypoints/serve/test_serve.py.)"""

import asyncio
import multiprocessing
import sqlite3

import pytest

from spmoe.entrypoints.serve.frontend.protocol import ApiError
from spmoe.entrypoints.serve.frontend.response_store import ResponseStore


def response(rid: str) -> dict:
    return {"id": rid, "object": "response", "output": [{"type": "message", "text": rid * 3}]}


def conversation(rid: str) -> list[dict]:
    return [
        {"role": "user", "content": f"question {rid}"},
        {"role": "assistant", "content": rid * 3},
    ]


def stored_ids(path) -> list[str]:
    with sqlite3.connect(path) as db:
        return [row[0] for row in db.execute("SELECT id FROM responses ORDER BY seq")]


async def check_kept(path: str) -> None:
    first, second = ResponseStore(path, capacity=3), ResponseStore(path, capacity=3)
    for i, store in enumerate([first, second, first, second, first]):
        await store.put(response(f"r{i}"), conversation(f"r{i}"))
    assert stored_ids(path) == ["r2", "r3", "r4"]
    for store in (first, second, ResponseStore(path, capacity=3)):
        for rid in ("r2", "r3", "r4"):
            assert await store.get(rid) == (conversation(rid), response(rid))
        with pytest.raises(ApiError) as missing:
            await store.get("r1")
        assert (missing.value.status, missing.value.param) == (404, None)
        assert "'r1'" in missing.value.message and "3 most recent" in missing.value.message
        with pytest.raises(ApiError) as missing:
            await store.get("r0", "previous_response_id")
        assert (missing.value.status, missing.value.param) == (400, "previous_response_id")


def test_the_most_recent_are_kept_for_every_connection(tmp_path):
    asyncio.run(check_kept(str(tmp_path / "responses.sqlite")))


async def put_many(path: str, prefix: str, count: int, capacity: int) -> None:
    store = ResponseStore(path, capacity)
    for i in range(count):
        await store.put(response(f"{prefix}{i}"), conversation(f"{prefix}{i}"))


def put_many_here(*args) -> None:
    asyncio.run(put_many(*args))


@pytest.mark.parametrize("capacity", [1000, 250])
def test_two_processes_putting_at_once_lose_nothing(tmp_path, capacity):
    path, count = str(tmp_path / "responses.sqlite"), 200
    ResponseStore(path, capacity)  # the database made once, as the first front end makes it
    spawn = multiprocessing.get_context("spawn")
    writers = [
        spawn.Process(target=put_many_here, args=(path, prefix, count, capacity)) for prefix in "ab"
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
        assert writer.exitcode == 0
    ids = stored_ids(path)
    assert len(ids) == min(capacity, 2 * count), len(ids)
    # each writer's puts are in its order, and its last ones are the most recent
    for prefix in "ab":
        mine = [int(rid[1:]) for rid in ids if rid[0] == prefix]
        assert mine == list(range(count - len(mine), count)), mine
    last = f"a{count - 1}"
    assert asyncio.run(ResponseStore(path, capacity).get(last)) == (
        conversation(last),
        response(last),
    )


def open_store_here(path: str, start) -> None:
    start.wait()
    ResponseStore(path)


def test_front_ends_starting_at_once_all_open_the_new_database(tmp_path):
    """Processes opening one new database at the same moment (as the front ends of a server start):
    each opens it (no "database is locked" from two connections switching it to WAL at once), and
    it is in WAL mode with its table."""
    path = str(tmp_path / "responses.sqlite")
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Event()
    openers = [spawn.Process(target=open_store_here, args=(path, start)) for _ in range(6)]
    for opener in openers:
        opener.start()
    start.set()
    for opener in openers:
        opener.join(timeout=120)
    assert [opener.exitcode for opener in openers] == [0] * 6
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert db.execute("SELECT COUNT(*) FROM responses").fetchone() == (0,)
