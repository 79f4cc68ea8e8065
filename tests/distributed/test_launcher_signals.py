"""No process of a run outlives the launcher: SIGTERM, SIGKILL, and SIGINT sent to the launcher's whole
process group (what Ctrl-C does) while `spmoe generate` runs on 2 ranks end the ranks and the multiprocessing
resource tracker within 15 s. SIGTERM and SIGINT end the launcher with one line, no traceback."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

GRACE_S = 15.0


def process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, start time) of every process, from /proc/<pid>/stat."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # it ended while we looked
                continue
            table[int(entry.name)] = (int(fields[1]), fields[0], fields[19])
    return table


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid` -> its start time (so that a reused pid is not mistaken for it)."""
    table, found, frontier = process_table(), {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _, start) in table.items():
            if ppid == parent and child not in found:
                found[child] = start
                frontier.append(child)
    return found


def still_running(processes: dict[int, str]) -> list[int]:
    table = process_table()
    # a zombie has ended
    return [
        pid
        for pid, start in processes.items()
        if pid in table and table[pid][2] == start and table[pid][1] != "Z"
    ]


def start_generation(model: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """`spmoe generate` on 2 ranks, long enough to be signalled mid-run; returns once the ranks are decoding."""
    ids, err = tmp_path / "ids.json", tmp_path / "stderr.txt"
    ids.write_text(json.dumps([[3, 14, 15], [79], [38, 1], [5]]))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    with open(err, "w") as stderr:
        # its own process group, as a shell job has
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spmoe",
                "generate",
                "--model",
                model,
                "--tp",
                "2",
                "--sp",
                "on",
                "--input-ids",
                str(ids),
                "--max-new-tokens",
                "20000",
                "--output",
                str(tmp_path / "out.json"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    # the first progress line comes after the first step
    while "generating:" not in err.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.2)
    return proc, err


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "SIGINT to the process group"])
def test_no_process_of_the_run_outlives_the_launcher(how, engine_checkpoint, tmp_path):
    proc, err = start_generation(engine_checkpoint, tmp_path)
    run = descendants(proc.pid)
    try:
        assert len(run) >= 3, run  # 2 ranks and the resource tracker
        if how == "SIGINT to the process group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, getattr(signal, how))
        returncode = proc.wait(timeout=GRACE_S)
        deadline = time.monotonic() + GRACE_S
        while still_running(run) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert still_running(run) == [], (
            f"still running {GRACE_S} s after {how}: {still_running(run)}"
        )
    finally:  # if an assertion failed: end what this test started, by pid
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in still_running(run):
            os.kill(pid, signal.SIGKILL)
    stderr = err.read_text()
    if how == "SIGKILL":
        assert returncode == -signal.SIGKILL
        return
    name = "SIGTERM" if how == "SIGTERM" else "SIGINT"
    assert returncode == 128 + getattr(signal, name)
    assert "Traceback" not in stderr, stderr
    assert (
        stderr.strip().splitlines()[-1]
        == f"spmoe generate: stopped by {name}; every rank was ended"
    ), stderr
