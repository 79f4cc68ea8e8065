"""Soak `spmoe serve` (or any server with its routes and metrics): a seeded hostile mix for a given
time, with the server's invariants checked as it runs. Prints its progress, writes a JSON report and
exits 1 if any check failed.

    python benchmarks/soak.py --duration 1800 --json soak.json
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid SERVE_PID --duration 600

Without --url it starts `spmoe serve` itself on the demo checkpoint (or --model) with
--api-server-count 2 and MTP (2 drafts), and stops it with SIGTERM at the end. `--concurrency`
clients each send one call after another from the mix (`soak_mix.py`: whole and streamed
completions, streams cut mid-way, slow readers, n > 1 with logprobs, a new JSON schema or set of
forced tools per call, the Responses API with stored responses, long and prefix-sharing prompts,
malformed requests); every `--burst-every` seconds `--burst-size` short completions go at once, past
the server's queue; one front end is killed with SIGKILL at `--kill-at` of the run.

The checks (`soak_check.py` defines each):
- every request gets exactly one terminal outcome, within its deadline (`--deadline` s, plus a slow
  reader's pauses), and one its call allows; checked each second as well as at the end;
- after the warm-up (`--warmup` of the run) the load pauses and the server must drain to idle: the
  engine's requests running and waiting, its KV cache use and the per-request tables
  (`spmoe:request_table_entries`: the scheduler's, the blocks', the engine loop's, the front end's
  open streams) back to what they were before any load;
  the same at the end;
- each process of the server (sampled every second from /proc): RSS after the warm-up grows at most
  `--max-rss-growth` (end against start, and the least-squares slope over the window, both on the
  floor it keeps), and its open fds once idle at the end are no more than once idle after the
  warm-up;
- the killed front end is replaced within `RESTART_LIMIT_S` (a new process of the server, which then
  listens on the port: the time it took is reported), or, with --allow-stop, the whole server stops
  within that time; no other process exits;
- a server the soak started exits 0 after SIGTERM and leaves no process.
"""

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families
from soak_check import Ledger, flatness, idle_differences
from soak_mix import Call, Mix, Seen, send
from soak_procs import Watch, alive, tree

from spmoe.distributed.launcher import free_port

START_TIMEOUT_S = 300
MAX_NUM_WAITING = 32  # of a started server: a burst of --burst-size goes past it
UNREACHABLE_PAUSE_S = 0.5  # a client's wait after a refused connection
ABANDON_S = 10.0  # past a request's deadline, the client stops waiting (the request has failed)
IDLE_SCRAPES = (
    8  # consecutive idle scrapes of /metrics that make an idle server (several front ends)
)
FD_SETTLE_S = 10.0  # for fds to come back once idle
RESTART_LIMIT_S = 5.0  # a killed front end restarted, or the server stopped, within this
WATCH_KILL_S = 90.0  # how long the soak watches after a kill (a front end may start slowly)
STOP_TIMEOUT_S = 60.0  # for a started server to exit after SIGTERM
COUNTERS = ("spmoe:engine_steps_total", "vllm:generation_tokens_total")  # for the progress
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
TABLES = "spmoe:request_table_entries"
MiB = 2**20
SERIES_EVERY = 10  # the report keeps every tenth sample of each process


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="a running server (default: start spmoe serve)")
    p.add_argument(
        "--pid", type=int, help="with --url: the server's process, for /proc and the kill"
    )
    p.add_argument("--model", help="without --url: the checkpoint (default: the demo)")
    p.add_argument("--api-server-count", type=int, default=2, help="without --url (default 2)")
    p.add_argument(
        "--mtp", type=int, default=2, help="without --url: MTP drafts, 0: none (default 2)"
    )
    p.add_argument("--serve-arg", action="append", default=[], help="more for spmoe serve")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    p.add_argument("--warmup", type=float, default=0.25, help="share of --duration (default 0.25)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=8, help="clients (default 8)")
    p.add_argument(
        "--deadline", type=float, default=300.0, help="seconds per request (default 300)"
    )
    p.add_argument("--burst-every", type=float, default=20.0, help="seconds (default 20; 0: none)")
    p.add_argument("--burst-size", type=int, default=80, help="requests at once (default 80)")
    p.add_argument(
        "--kill-at", type=float, default=0.6, help="share of the run (default 0.6; 0: no kill)"
    )
    p.add_argument("--allow-stop", action="store_true", help="a kill may stop the whole server")
    p.add_argument("--max-rss-growth", type=float, default=0.02, help="default 0.02 (2%%)")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--progress", type=float, default=5.0, help="seconds between lines (default 5)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--events", type=Path, help="write every request's events here (JSON lines)")
    p.add_argument(
        "--server-log", type=Path, help="without --url: the server's output (default: a temp file)"
    )
    args = p.parse_args(argv)
    if args.url is None and args.pid is not None:
        p.error("--pid goes with --url")
    if not 0 < args.warmup < 1 or not 0 <= args.kill_at < 1:
        p.error("--warmup must be in (0, 1) and --kill-at in [0, 1)")
    return args


class Server:
    """`spmoe serve` started by the soak, on a free port, its output to `log`."""

    def __init__(self, args: argparse.Namespace, log: Path):
        port = free_port()
        self.command = [
            sys.executable,
            "-m",
            "spmoe",
            "serve",
            *([args.model] if args.model else []),
        ]
        self.command += ["--port", str(port), "--api-server-count", str(args.api_server_count)]
        if args.mtp:
            spec = {"method": "mtp", "num_speculative_tokens": args.mtp}
            self.command += ["--speculative-config", json.dumps(spec)]
        self.command += ["--tool-call-parser", "glm47", "--enable-auto-tool-choice"]
        self.command += ["--shutdown-timeout", "5", "--max-num-waiting", str(MAX_NUM_WAITING)]
        self.command += args.serve_arg
        self.log, self.url = log, f"http://127.0.0.1:{port}"
        with open(log, "w") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
        try:
            self.wait_ready()
        except BaseException:
            # not ready in time, or the soak itself stopped (SIGTERM, Ctrl-C): nothing left behind
            self.stop(tree(self.proc.pid))
            raise

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "ready: http://" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"spmoe serve did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self, watched: list[int]) -> dict:
        """SIGTERM, then the exit code and the processes of the server still alive after it."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = f"still running {STOP_TIMEOUT_S:g} s after SIGTERM (killed)"
        time.sleep(1.0)
        left = [pid for pid in watched if alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        return {"exit_code": code, "left_processes": left}


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, root: int | None):
        self.args, self.url = args, url.rstrip("/")
        self.port = urlsplit(self.url).port
        self.watch = Watch(root, self.port) if root is not None else None
        self.ledger = Ledger()
        self.events = open(args.events, "w") if args.events else None
        self.began = time.monotonic()
        self.stopping = asyncio.Event()  # the load's clients stop
        self.server_gone = False
        self.kill: dict | None = None
        # the engine's gauges and counters at each progress line
        self.engine_series: list[dict] = []
        self.sent = 0
        self.client = httpx.AsyncClient(
            base_url=self.url,
            timeout=None,
            # a connection per request: every one is a new pick of the front ends sharing the port
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )

    def now(self) -> float:
        return time.monotonic() - self.began

    def say(self, line: str) -> None:
        print(f"soak {self.now():7.1f} s  {line}", flush=True)

    def record(self, event: dict) -> None:
        self.ledger.feed(event)
        if self.events is not None:
            self.events.write(json.dumps(event) + "\n")

    # -- requests ---------------------------------------------------------------------------------

    async def request(self, call: Call, request_id: str) -> Seen:
        """Send `call` and record what came of it (or that the client gave up past the deadline)."""
        allowance = self.args.deadline + call.pauses_s
        sent = self.now()
        self.sent += 1
        self.record(
            {
                "event": "sent",
                "id": request_id,
                "kind": call.kind,
                "t": sent,
                "deadline": sent + allowance,
                "allowed": list(call.allowed),
            }
        )
        try:
            async with asyncio.timeout(allowance + ABANDON_S):
                seen = await send(self.client, call, request_id)
        except TimeoutError:
            self.record({"event": "abandoned", "id": request_id, "t": self.now()})
            return Seen("abandoned")
        event = {"event": "outcome", "id": request_id, "t": self.now(), "outcome": seen.outcome}
        self.record({**event, "status": seen.status, "detail": seen.detail})
        if not self.ledger.allows(self.ledger.entries[request_id]):
            self.say(
                f"NOT ALLOWED {request_id} ({call.kind}): "
                f"{seen.outcome} {seen.status} {seen.detail}"
            )
        return seen

    async def client_loop(self, mix: Mix, name: str) -> None:
        """One client: call after call from the mix, its own seeded draw (`name`: its phase and
        index), until the load stops."""
        rng = random.Random(f"{self.args.seed}-{name}")
        for k in itertools.count(1):
            if self.stopping.is_set():
                return
            call = mix.next(rng, f"{name}x{k}")
            seen = await self.request(call, f"soak-{name}-{k}")
            if seen.retry_after_s is not None:  # the queue is full: as a client should, wait
                await asyncio.sleep(seen.retry_after_s)
            elif seen.outcome == "unreachable":  # nothing listens (a restart): not in a tight loop
                await asyncio.sleep(UNREACHABLE_PAUSE_S)
            if call.kind == "responses":
                follow = mix.after_response(rng, (seen.answer or {}).get("id", ""))
                if seen.outcome == "ok" and call.body["store"]:
                    for j, more in enumerate(follow):
                        await self.request(more, f"soak-{name}-{k}-{j}")

    async def bursts(self, mix: Mix, phase: str) -> None:
        rng = random.Random(f"{self.args.seed}-burst-{phase}")
        count = 0
        while self.args.burst_every > 0:
            try:
                await asyncio.wait_for(self.stopping.wait(), self.args.burst_every)
                return
            except TimeoutError:
                pass
            count += 1
            calls = [mix.burst(rng) for _ in range(self.args.burst_size)]
            ids = [f"soak-burst-{phase}{count}-{i}" for i in range(len(calls))]
            await asyncio.gather(*(self.request(c, rid) for c, rid in zip(calls, ids)))

    async def load(self, mix: Mix, seconds: float, phase: str) -> None:
        """The mix for `seconds` (less if the server goes away); returns once every call has
        ended."""
        self.stopping.clear()
        tasks = [
            asyncio.create_task(self.client_loop(mix, f"{phase}{i}"))
            for i in range(self.args.concurrency)
        ]
        tasks.append(asyncio.create_task(self.bursts(mix, phase)))
        try:
            await asyncio.wait_for(self.stopping.wait(), seconds)
        except TimeoutError:
            pass
        self.stopping.set()
        await asyncio.gather(*tasks)

    # -- the server's state -----------------------------------------------------------------------

    async def gauges(self, also: tuple[str, ...] = ()) -> dict[str, float]:
        """The idle-relevant gauges of one /metrics scrape: requests running and waiting, KV cache
        use, and each per-request table's entries (`TABLES`, labelled by table); and the samples
        `also` names."""
        text = (await self.client.get("/metrics")).text
        found = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in GAUGES or sample.name in also:
                    found[sample.name] = sample.value
                elif sample.name == TABLES:
                    found[f"{TABLES}{{table={sample.labels['table']}}}"] = sample.value
        return found

    async def drain(self, baseline: dict[str, float]) -> dict:
        """Wait until `IDLE_SCRAPES` scrapes in a row show `baseline` (each may reach another front
        end). -> {seconds to idle (None: not within --drain-timeout), the last gauges, what
        differed}."""
        began, in_a_row, last = self.now(), 0, {}
        while self.now() - began < self.args.drain_timeout:
            try:
                last = await self.gauges()
            except httpx.HTTPError as e:
                last = {"error": repr(e)}
            in_a_row = in_a_row + 1 if not idle_differences(baseline, last) else 0
            if in_a_row >= IDLE_SCRAPES:
                return {"seconds": round(self.now() - began, 2), "gauges": last, "differences": {}}
            await asyncio.sleep(0.25)
        return {"seconds": None, "gauges": last, "differences": idle_differences(baseline, last)}

    async def settled_fds(self, baseline: dict[int, int] | None) -> dict[int, int]:
        """Open fds per process once idle: sampled until no process has more than in `baseline` (or
        two samples a second apart agree, without one), for up to `FD_SETTLE_S`."""
        previous, began = None, self.now()
        while True:
            current = self.watch.fds()
            if baseline is not None:
                if all(current[p] <= baseline.get(p, current[p]) for p in current):
                    return current
            elif current == previous:
                return current
            if self.now() - began > FD_SETTLE_S:
                return current
            previous = current
            await asyncio.sleep(1.0)

    async def sampler(self) -> None:
        """Sample the processes every second; notice a server that has gone away."""
        while True:
            await asyncio.to_thread(self.watch.sample, self.now())
            if not alive(self.watch.root) and not self.server_gone:
                self.server_gone = True
                self.record({"event": "disruption", "kind": "stop", "t": self.now()})
                self.say("the server's process has exited")
                self.stopping.set()
            await asyncio.sleep(1.0)

    async def progress(self) -> None:
        """A line every --progress seconds; requests past their deadline as soon as they are."""
        last = 0.0
        while True:
            await asyncio.sleep(1.0)
            for rid in self.ledger.overdue(self.now()):
                entry = self.ledger.entries[rid]
                self.say(
                    f"OVERDUE {rid} ({entry.kind}): no outcome "
                    f"{entry.deadline - entry.sent:.0f} s after it was sent"
                )
            if self.now() - last >= self.args.progress:
                last = self.now()
                try:
                    engine = await self.gauges(COUNTERS)
                    self.engine_series.append({"t": round(self.now(), 1), **engine})
                except httpx.HTTPError as e:
                    engine = {"/metrics": repr(e)}
                self.say(self.status_line(engine))

    def status_line(self, engine: dict) -> str:
        report = self.ledger.report(self.now())
        counts = " ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items()))
        bad = sum(report["violations"].values())
        line = f"sent {self.sent}: {counts}; in flight {report['in_flight']}; violations {bad}"
        line += " | " + ", ".join(f"{k.split(':')[-1]} {v:g}" for k, v in engine.items())
        if self.watch is not None:
            rss = []
            for pid, entry in self.watch.series.items():
                if alive(pid) and entry["samples"]:
                    rss.append(f"{entry['label']} {entry['samples'][-1][1] / MiB:.0f}")
            line += " | RSS MiB: " + ", ".join(rss)
        return line

    async def kill_front_end(self, at: float) -> None:
        """At `at` s: SIGKILL one front end, then watch for its replacement (a new process in the
        server's tree, then listening on the port) or the server's stop."""
        await asyncio.sleep(max(0.0, at - self.now()))
        fronts = list(self.watch.front_ends)
        if self.stopping.is_set() or not fronts:
            return
        before = set(self.watch.pids())
        victim = random.Random(f"{self.args.seed}-kill").choice(sorted(fronts))
        os.kill(victim, signal.SIGKILL)
        t = self.now()
        self.record({"event": "disruption", "kind": "kill", "t": t, "pid": victim})
        self.say(f"killed front end {victim} (SIGKILL), {len(fronts)} were listening")
        self.kill = {"pid": victim, "t": round(t, 2), "front_ends": len(fronts), "outcome": None}
        while self.now() - t < WATCH_KILL_S:
            await asyncio.sleep(0.05)
            since = round(self.now() - t, 2)
            if not any(alive(pid) for pid in self.watch.seen):
                self.kill.update(outcome="stopped", seconds=since)
                break
            if self.server_gone:
                continue
            new = sorted(set(self.watch.pids()) - before)
            if new and "replaced_s" not in self.kill:
                self.kill.update(replaced_s=since, new=new)
            current = self.watch.listening()
            if victim not in current and len(current) >= len(fronts):
                self.kill.update(outcome="restarted", seconds=since, listening=current)
                self.record({"event": "disruption", "kind": "restored", "t": self.now()})
                break
        self.say(f"after the kill: {self.kill}")

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> dict:
        models = (await self.client.get("/v1/models")).json()["data"][0]
        mix = Mix(models["id"], models["max_model_len"])
        watchers = [asyncio.create_task(self.progress())]
        if self.watch is not None:
            await asyncio.to_thread(self.watch.sample, self.now())
            watchers.append(asyncio.create_task(self.sampler()))
        start = await self.gauges()
        warmup_s = self.args.duration * self.args.warmup
        self.say(f"warm-up: {warmup_s:.0f} s of the mix on {models['id']} ({self.url})")
        await self.load(mix, warmup_s, "w")
        drains = {"warm_up": await self.drain(start)}
        self.say(f"drained after the warm-up: {drains['warm_up']}")
        fds_warm = await self.settled_fds(None) if self.watch is not None else {}
        window_from = self.now()
        rest = self.args.duration - warmup_s
        if self.args.kill_at and self.watch is not None and len(self.watch.front_ends) > 0:
            at = window_from + self.args.duration * self.args.kill_at - warmup_s
            watchers.append(asyncio.create_task(self.kill_front_end(max(at, window_from))))
        self.say(f"load: {rest:.0f} s")
        await self.load(mix, rest, "l")
        window_to = self.now()
        fds_end: dict[int, int] = {}
        if not self.server_gone:
            drains["end"] = await self.drain(start)
            self.say(f"drained at the end: {drains['end']}")
            if self.watch is not None:
                fds_end = await self.settled_fds(fds_warm)
        for task in watchers:
            task.cancel()
        await self.client.aclose()
        if self.events is not None:
            self.events.close()
        report = {
            "requests": self.ledger.report(self.now()),
            "idle_before_load": start,
            "drain": drains,
            "kill": self.kill,
            "server_stopped": self.server_gone,
            "window": [round(window_from, 1), round(window_to, 1)],
            "engine": self.engine_series,
        }
        if self.watch is not None:
            report["processes"] = self.processes(window_from, window_to, fds_warm, fds_end)
        return report

    def processes(self, since: float, until: float, fds_warm: dict, fds_end: dict) -> list[dict]:
        """Per process: RSS and fds flatness over the load after the warm-up (a process that started
        later: from its own first sample plus the warm-up's length), fds once idle after the warm-up
        and at the end, and whether it lived through the run."""
        found = []
        warmup_s = self.args.duration * self.args.warmup
        for pid, entry in sorted(self.watch.series.items()):
            samples = [s for s in entry["samples"] if s[0] <= until]
            first, last = samples[0][0], samples[-1][0]
            # a process that started after the warm-up (a replaced front end) warms up too, from
            # when it serves
            start = since if first <= since else entry.get("listening_from", first) + warmup_s
            found.append(
                {
                    "pid": pid,
                    "label": entry["label"],
                    "first_seen": round(first, 1),
                    "last_seen": round(last, 1),
                    "alive_at_end": alive(pid),
                    "rss": flatness([(t, rss) for t, rss, _ in samples], start),
                    "fds": flatness([(t, fds) for t, _, fds in samples], start),
                    "fds_idle": [fds_warm.get(pid), fds_end.get(pid)],
                    # every SERIES_EVERY-th sample: seconds, RSS MiB, fds
                    "series": [
                        [round(t, 1), round(rss / MiB, 2), fds]
                        for t, rss, fds in samples[::SERIES_EVERY]
                    ],
                }
            )
        return found


def verdict(args: argparse.Namespace, report: dict) -> list[str]:
    """Every failed check, in words (none: the soak passed)."""
    failures = []
    requests = report["requests"]
    words = {
        "no_outcome": "without a terminal outcome within their deadline",
        "several_outcomes": "with more than one outcome",
        "late": "with their outcome after their deadline",
        "not_allowed": "with an outcome their call does not allow (broken, wrong or unexpected)",
    }
    for name, count in requests["violations"].items():
        if count:
            failures.append(f"{count} requests {words[name]}")
    if requests["in_flight"]:
        failures.append(f"{requests['in_flight']} requests still in flight at the end")
    for phase, drain in report["drain"].items():
        if drain["seconds"] is None:
            failures.append(
                f"not idle within {args.drain_timeout:g} s ({phase}): {drain['differences']}"
            )
    kill = report["kill"]
    if kill is not None:
        # the supervisor's act is timed: a new process (restarted), or the server gone (stopped)
        acted_s = kill.get("replaced_s") if kill["outcome"] == "restarted" else kill.get("seconds")
        if kill["outcome"] is None:
            failures.append(
                f"front end {kill['pid']} killed: no front end listens in its place and the "
                f"server has not stopped, {WATCH_KILL_S:g} s later"
            )
        elif acted_s > RESTART_LIMIT_S:
            failures.append(
                f"front end {kill['pid']} killed: {kill['outcome']} after {acted_s} s, "
                f"more than {RESTART_LIMIT_S:g} s"
            )
        if kill["outcome"] == "stopped" and not args.allow_stop:
            failures.append(f"front end {kill['pid']} killed: the server stopped")
    if report["server_stopped"] and (kill is None or kill["outcome"] != "stopped"):
        failures.append("the server stopped during the run")
    killed = kill["pid"] if kill else None
    for proc in report.get("processes", []):
        if proc["pid"] != killed and not proc["alive_at_end"] and not report["server_stopped"]:
            failures.append(f"{proc['label']} exited during the run")
        rss = proc["rss"]
        if rss is not None and max(rss["growth"], rss["slope_growth"]) > args.max_rss_growth:
            failures.append(
                f"{proc['label']}: RSS grew {100 * rss['growth']:.2f}% after the warm-up "
                f"(slope {100 * rss['slope_growth']:.2f}% over the window), more than "
                f"{100 * args.max_rss_growth:g}%"
            )
        warm, end = proc["fds_idle"]
        if warm is not None and end is not None and end > warm:
            failures.append(
                f"{proc['label']}: open fds once idle {warm} after the warm-up, {end} at the end"
            )
    server = report.get("server")
    if server and not report["server_stopped"]:
        if server["exit_code"] != 0:
            failures.append(f"the server's exit after SIGTERM: {server['exit_code']}")
        if server["left_processes"]:
            failures.append(f"processes left after the server exited: {server['left_processes']}")
    return failures


def commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def exit_on_sigterm(signum, frame) -> None:
    """SIGTERM ends the soak as Ctrl-C does: the server it started is stopped on the way out."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    server = None
    if args.url is None:
        log = args.server_log or Path(f"/tmp/soak-server-{os.getpid()}.log")
        server = Server(args, log)
        url, root = server.url, server.proc.pid
        print(f"soak: started {' '.join(server.command)} (output in {log})", flush=True)
    else:
        url, root = args.url, args.pid
    soak = Soak(args, url, root)
    try:
        report = asyncio.run(soak.run())
    except BaseException:
        if server is not None:
            server.stop(soak.watch.seen)
        raise
    if server is not None:
        report["server"] = {"command": server.command, **server.stop(soak.watch.seen)}
    failures = verdict(args, report)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": f"{platform.node()}: {platform.platform()}, {os.cpu_count()} CPUs",
        "command": [sys.executable, *sys.argv],
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **report,
        "verdict": {"pass": not failures, "failures": failures},
    }
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps({"requests": report["requests"]["requests"], **report["verdict"]}, indent=1))
    print("soak: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
