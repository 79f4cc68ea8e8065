"""The soak's checks (`benchmarks/soak.py`), as functions of what it recorded: no I/O, so that a
fabricated record can prove each check fails when it should.

Terminal outcomes. A request's outcome is what its client saw, one of `OUTCOMES`. It is terminal
because after it the client has nothing left to wait for: an answer it can use, an error that says
why, or a connection that is gone. A request must get exactly one within its deadline, and one its
call allows (`Ledger`): a valid request a whole answer, `cut` (its client left on purpose) or a 503
(the queue is full); a malformed one a 4xx. A front end killed mid-load (`disruption`) may in
addition close the connections it held, or end them with an error: those it held are the requests
in flight at the kill and those sent up to `KILL_GRACE_S` after it (a connection the kernel had
already queued on the killed process). Once the server has stopped, a connection may also be
refused (`unreachable`).

Flatness (`flatness`): a resource sampled over the run (a process's RSS, its open fds) from the end
of the warm-up on, as the floor it keeps (the minimum of each tenth of the window): growth from the
first tenth's floor to the last's, and the least-squares slope of the floors, as growth over the
window.
"""

import statistics
from dataclasses import dataclass, field

OUTCOMES = {
    "ok": "a whole answer: a 2xx JSON body of the route's shape, or a stream that ended as its "
    "protocol ends (every choice's finish_reason, then [DONE]; a Responses stream's "
    "response.completed)",
    "refused": "a 4xx or 5xx status with an OpenAI error body {'error': {'message': ...}}",
    "stream_error": "a 200 stream that ended with an error event (then [DONE] where the route "
    "sends it)",
    "closed": "the server closed the connection before a whole answer (an incomplete body, a "
    "reset): the client sees the end",
    "unreachable": "no connection: nothing listened on the port",
    "cut": "the client left on purpose (a stream cut mid-way); the server must abort the request",
    "broken": "not one clear outcome: a 2xx body that is not the route's JSON, an error status "
    "without an error body, data after the stream's end, a stream that ended without its end",
    "wrong": "a whole answer that breaks the request: not n choices, logprobs missing, output "
    "that does not follow its schema",
}
# never allowed: they are not a clear outcome, or not the answer asked for
FAILURES = ("broken", "wrong")
KILL_GRACE_S = 1.0
# what a request in flight at a disruption may also get, and one after the server stopped
DISRUPTED = ("closed", "stream_error", "refused:5xx")
STOPPED = (*DISRUPTED, "unreachable")
MIN_FLAT_SAMPLES = 20  # fewer samples after the warm-up: too short to judge
SLICES = 10  # a flatness window's slices, each giving its floor
SHOWN = 20  # violations listed in full in the report (all are counted)


def matches(outcome: str, status: int | None, allowed: str) -> bool:
    """Whether an outcome (with its HTTP status) is one that `allowed` names: an outcome ("ok"), or
    "refused:" and a status ("refused:503") or class ("refused:4xx")."""
    if ":" not in allowed:
        return outcome == allowed
    kind, code = allowed.split(":")
    if outcome != kind or status is None:
        return False
    return str(status) == code or (code.endswith("xx") and str(status)[0] == code[0])


@dataclass
class Entry:
    kind: str
    sent: float  # seconds since the soak began
    deadline: float
    allowed: tuple[str, ...]
    outcomes: list[dict] = field(default_factory=list)


class Ledger:
    """Every request sent and the outcomes it got, fed as the soak runs (or replayed from its event
    log, `replay`), with the violations found so far."""

    def __init__(self):
        self.entries: dict[str, Entry] = {}
        self.disruptions: list[dict] = []  # {"t", "kind": "kill" | "restored" | "stop"}
        self.overdue_seen: set[str] = set()

    def feed(self, event: dict) -> None:
        """One event of the log: {"event": "sent" | "outcome" | "disruption" | "abandoned", ...}
        ("abandoned": the client stopped waiting, some time after the deadline; not an outcome)."""
        kind = event["event"]
        if kind == "sent":
            self.entries[event["id"]] = Entry(
                event["kind"], event["t"], event["deadline"], tuple(event["allowed"])
            )
        elif kind == "outcome":
            self.entries[event["id"]].outcomes.append(event)
        elif kind == "disruption":
            self.disruptions.append(event)
        elif kind != "abandoned":
            raise ValueError(f"an event is sent, outcome, disruption or abandoned, got {kind!r}")

    def allowed(self, entry: Entry) -> tuple[str, ...]:
        """What `entry` may get: its own, and what a disruption it was caught in allows. A kill
        catches the requests in flight at it and those sent up to `KILL_GRACE_S` after it; until the
        front ends are back ("restored"), a connection may be refused. A stop catches every request
        that had not ended by then."""
        extra: tuple[str, ...] = ()
        ended = entry.outcomes[0]["t"] if entry.outcomes else float("inf")
        for d in self.disruptions:
            t = d["t"]
            if d["kind"] == "stop" and ended >= t:
                extra += STOPPED
            elif d["kind"] == "kill":
                back = [r["t"] for r in self.disruptions if r["kind"] == "restored" and r["t"] >= t]
                if entry.sent <= t + KILL_GRACE_S and ended >= t:
                    extra += DISRUPTED
                if t <= entry.sent <= min(back, default=float("inf")):
                    extra += ("unreachable",)
        return entry.allowed + extra

    def allows(self, entry: Entry) -> bool:
        """Whether `entry`'s first outcome is one it may get."""
        first = entry.outcomes[0]
        name, status = first["outcome"], first.get("status")
        return name not in FAILURES and any(matches(name, status, a) for a in self.allowed(entry))

    def overdue(self, now: float) -> list[str]:
        """Requests past their deadline without an outcome, not reported before."""
        found = [
            rid
            for rid, e in self.entries.items()
            if not e.outcomes and now > e.deadline and rid not in self.overdue_seen
        ]
        self.overdue_seen.update(found)
        return found

    def report(self, now: float) -> dict:
        """Counts by outcome, status and kind, and every violation at time `now`: no outcome by the
        deadline, several outcomes, an outcome after the deadline, one not allowed."""
        outcomes: dict[str, int] = {}
        statuses: dict[str, int] = {}
        by_kind: dict[str, dict[str, int]] = {}
        violations: dict[str, list] = {
            "no_outcome": [],
            "several_outcomes": [],
            "late": [],
            "not_allowed": [],
        }
        in_flight = 0
        for rid, e in self.entries.items():
            if not e.outcomes:
                if now > e.deadline:
                    violations["no_outcome"].append(
                        {"id": rid, "kind": e.kind, "sent": e.sent, "deadline": e.deadline}
                    )
                else:
                    in_flight += 1
                continue
            if len(e.outcomes) > 1:
                violations["several_outcomes"].append({"id": rid, "outcomes": e.outcomes})
            first = e.outcomes[0]
            name, status = first["outcome"], first.get("status")
            outcomes[name] = outcomes.get(name, 0) + 1
            if status is not None:
                statuses[str(status)] = statuses.get(str(status), 0) + 1
            kind = by_kind.setdefault(e.kind, {})
            kind[name] = kind.get(name, 0) + 1
            if first["t"] > e.deadline:
                violations["late"].append({"id": rid, "kind": e.kind, **first})
            if not self.allows(e):
                violations["not_allowed"].append(
                    {"id": rid, "kind": e.kind, "allowed": self.allowed(e), **first}
                )
        return {
            "requests": len(self.entries),
            "in_flight": in_flight,
            "outcomes": outcomes,
            "statuses": statuses,
            "by_kind": by_kind,
            "violations": {name: len(found) for name, found in violations.items()},
            "examples": {name: found[:SHOWN] for name, found in violations.items() if found},
            "pass": not any(violations.values()) and in_flight == 0,
        }


def replay(events: list[dict], now: float) -> dict:
    """The ledger's report for an event log (in the order written) at time `now`."""
    ledger = Ledger()
    for event in events:
        ledger.feed(event)
    return ledger.report(now)


def flatness(samples: list[tuple[float, float]], since: float) -> dict | None:
    """`samples` (t, value) from `since` on, as the floor they keep: the window cut into `SLICES`
    slices of as many samples, each slice's minimum (a transient peak, a long prompt's activations,
    leaves it; retained memory raises it). -> {samples, seconds, start and end (the first and last
    slice's floor), growth (end / start - 1), slope_per_hour (least squares over the floors),
    slope_growth (that slope over the window / start)}; None when fewer than `MIN_FLAT_SAMPLES`
    (too short to judge)."""
    window = [(t, v) for t, v in samples if t >= since]
    if len(window) < MIN_FLAT_SAMPLES:
        return None
    size = len(window) / SLICES
    slices = [window[round(i * size) : round((i + 1) * size)] for i in range(SLICES)]
    times = [statistics.fmean(t for t, _ in part) for part in slices]
    floors = [min(v for _, v in part) for part in slices]
    start, end = floors[0], floors[-1]
    seconds = window[-1][0] - window[0][0]
    slope = statistics.linear_regression(times, floors).slope
    return {
        "samples": len(window),
        "seconds": round(seconds, 1),
        "start": start,
        "end": end,
        "growth": end / start - 1 if start else 0.0,
        "slope_per_hour": slope * 3600,
        "slope_growth": slope * seconds / start if start else 0.0,
    }


def idle_differences(baseline: dict[str, float], now: dict[str, float]) -> dict[str, list]:
    """The gauges of an idle server (requests, KV cache use, per-request tables) that differ from
    `baseline`: name -> [baseline, now]; a gauge in only one of them counts as differing."""
    names = sorted(set(baseline) | set(now))
    return {n: [baseline.get(n), now.get(n)] for n in names if baseline.get(n) != now.get(n)}
