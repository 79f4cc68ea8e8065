"""A server's processes as the soak sees them, from /proc: the tree below the `spmoe serve` process,
each process's resident memory and open file descriptors, and which of them listen on the server's
port (the HTTP front ends, whatever their module is called)."""

import os
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"  # the TCP state in /proc/net/tcp


def parents() -> dict[int, int]:
    """pid -> parent pid, for every process."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            found[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return found


def tree(root: int) -> list[int]:
    """`root` (if alive) and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents().items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root] if alive(root) else []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(found)


def alive(pid: int) -> bool:
    """Running, and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass(frozen=True)
class Usage:
    rss_bytes: int
    fds: int


def usage(pid: int) -> Usage | None:
    """VmRSS and the count of open fds; None if the process is gone (a zombie, not yet reaped, has
    neither)."""
    if not alive(pid):
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss = next((int(ln.split()[1]) * 1024 for ln in status.splitlines() if ln[:6] == "VmRSS:"), 0)
    return Usage(rss, fds)


def socket_inodes(pid: int) -> set[str]:
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                found.add(target[8:-1])
    except OSError:
        pass
    return found


def listening_inodes(port: int) -> set[str]:
    """Inodes of the TCP sockets listening on `port` (IPv4 and IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(fields[9])
    return found


def listeners(pids: list[int], port: int) -> list[int]:
    """Those of `pids` that hold a socket listening on `port`."""
    inodes = listening_inodes(port)
    return [pid for pid in pids if socket_inodes(pid) & inodes]


def describe(pid: int, root: int, front_ends: list[int]) -> str:
    """A label for a server process: "server" (the command), "front end", "resource tracker", or
    "rank" (a process that runs the engine), with its pid."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    if pid == root:
        role = "server"
    elif pid in front_ends:
        role = "front end"
    elif b"resource_tracker" in cmdline:
        role = "resource tracker"
    else:
        role = "rank"
    return f"{role} {pid}"


class Watch:
    """The server's processes sampled over time: `series[pid]` = {"label", "samples": [(t, rss
    bytes, fds)], "listening_from": t (a front end)}; `seen`: every pid of the tree ever sampled."""

    def __init__(self, root: int, port: int):
        self.root, self.port = root, port
        self.series: dict[int, dict] = {}
        self.front_ends: list[int] = []

    @property
    def seen(self) -> list[int]:
        return sorted(self.series)

    def sample(self, t: float) -> None:
        """One sample of every process of the tree at time `t` (the soak's clock)."""
        pids = tree(self.root)
        self.front_ends = listeners(pids, self.port)
        for pid in pids:
            used = usage(pid)
            if used is None:
                continue
            entry = self.series.setdefault(
                pid, {"label": describe(pid, self.root, self.front_ends), "samples": []}
            )
            if pid in self.front_ends and "listening_from" not in entry:
                # a front end that started since: it listens now
                entry["label"] = describe(pid, self.root, self.front_ends)
                entry["listening_from"] = t
            entry["samples"].append((t, used.rss_bytes, used.fds))

    def pids(self) -> list[int]:
        """The processes of the tree now."""
        return tree(self.root)

    def listening(self) -> list[int]:
        """The processes of the tree listening on the port now."""
        return listeners(tree(self.root), self.port)

    def fds(self) -> dict[int, int]:
        """Open fds now, per live process of the tree."""
        found = {}
        for pid in tree(self.root):
            used = usage(pid)
            if used is not None:
                found[pid] = used.fds
        return found
