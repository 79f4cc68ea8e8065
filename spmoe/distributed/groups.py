"""Process groups: initialise from the torchrun environment, build the TP / DP / EP
groups, tear down.

gloo on CPU, NCCL on CUDA; on both, a gloo `control_group` over every rank carries host objects (the
serving loop's step plans, job results; `comm.broadcast_object` / `comm.gather_object`), and under
DP a gloo `tp_control_group` over each DP group's ranks (its TP rank 0's admissions; the control
group without DP). Every collective carries `timeout_s`, so a dead peer turns into an error on the
surviving ranks instead of a hang. On CUDA the TP and EP groups also get the one-shot kernels for
small collectives where the GPUs support them (`comm.enable_one_shot`).
"""

import dataclasses
import ipaddress
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from spmoe.config import ParallelConfig
from spmoe.distributed.comm import disable_one_shot, enable_one_shot, group_size
from spmoe.distributed.simulated import SimulatedGroup, is_simulated

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the world. The groups are torch ProcessGroups (or WORLD)."""

    config: ParallelConfig
    rank: int
    device: torch.device
    tp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    control_group: dist.ProcessGroup  # gloo, every rank: host objects only
    # gloo, this rank's DP group's ranks (the control group without DP)
    tp_control_group: dist.ProcessGroup

    @property
    def tp_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        return self.config.data_parallel_size

    @property
    def ep_size(self) -> int:
        return group_size(self.ep_group)

    @property
    def ep_rank(self) -> int:
        return self.ep_group.rank if is_simulated(self.ep_group) else dist.get_rank(self.ep_group)


_STATE: ParallelState | None = None


def init_distributed(
    config: ParallelConfig | None = None, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S
) -> ParallelState:
    """Join the process group described by RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    (and LOCAL_RANK).

    `config` defaults to pure tensor parallelism over the whole world. Its world size must match
    WORLD_SIZE. A `config.simulate_rank` makes this process rank 0 of the config's layout with the
    other ranks simulated (`spmoe.distributed.simulated`): no process group is joined.
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError(
            "init_distributed() was already called in this process; call "
            "destroy_distributed() first"
        )
    if config is not None and config.simulate_rank:
        _STATE = _simulated_state(config, device)
        return _STATE
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(f"init_distributed() needs the torchrun environment; missing {missing}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = config or ParallelConfig(tensor_parallel_size=world)
    if config.world_size != world:
        raise ValueError(
            "parallel config needs dp*tp = "
            f"{config.data_parallel_size}*{config.tensor_parallel_size} = {config.world_size} "
            f"ranks, but WORLD_SIZE is {world}"
        )
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was requested but torch.cuda.is_available() is False")
        local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
        dev, backend = torch.device("cuda", local_rank), "nccl"
    elif device == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if backend == "nccl" else None,
        store=_loopback_store(rank, world, timeout_s),
    )
    tp = config.tensor_parallel_size
    tp_group = dist.group.WORLD
    control_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    tp_control_group = control_group
    if config.data_parallel_size > 1:
        # new_group must be called by every rank for every group, in the same order.
        for d in range(config.data_parallel_size):
            ranks = list(range(d * tp, (d + 1) * tp))
            group = dist.new_group(ranks)
            control = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
            if d == rank // tp:
                tp_group, tp_control_group = group, control
    _STATE = ParallelState(
        config=config,
        rank=rank,
        device=dev,
        tp_group=tp_group,
        ep_group=dist.group.WORLD,
        control_group=control_group,
        tp_control_group=tp_control_group,
    )
    if backend == "nccl":
        groups = [("TP", tp_group)] + (
            [("EP", dist.group.WORLD)] if tp_group is not dist.group.WORLD else []
        )
        for name, group in groups:
            reason = enable_one_shot(group, dev) if dist.get_world_size(group) > 1 else None
            if reason and rank == 0:
                print(
                    f"spmoe: one-shot collectives unavailable on the {name} group, NCCL runs "
                    f"them all: {reason}",
                    flush=True,
                )
    return _STATE


def _simulated_state(config: ParallelConfig, device: str) -> ParallelState:
    """Rank 0 of `config`'s layout, alone: TP and EP groups of the layout's sizes, simulated; a
    control plane of one rank (DP 1: the rank serves its DP group's share itself)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was requested but torch.cuda.is_available() is False")
        dev = torch.device("cuda", torch.cuda.current_device())
    elif device == "cpu":
        dev = torch.device("cpu")
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    control = SimulatedGroup("control", 1)
    return ParallelState(
        config=dataclasses.replace(config, data_parallel_size=1),
        rank=0,
        device=dev,
        tp_group=SimulatedGroup("tp", config.tensor_parallel_size),
        ep_group=SimulatedGroup("ep", config.world_size),
        control_group=control,
        tp_control_group=control,
    )


def _loopback_store(rank: int, world: int, timeout_s: float) -> dist.TCPStore | None:
    """The rendezvous store when every rank is on this machine (MASTER_ADDR is a loopback address):
    rank 0 listens on that address only, where torch's own store would listen on every interface.
    None (torch makes its store from the environment) for ranks on several machines, or under
    torchrun's agent store."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not _is_loopback(host):
        return None
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout)
    listener = socket.create_server(
        (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
    )
    # the store owns it
    return dist.TCPStore(host, port, world, True, timeout, master_listen_fd=listener.detach())


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError(
            "distributed state is not initialised; call spmoe.distributed.init_distributed() first"
        )
    return _STATE


def is_first_rank() -> bool:
    """True on global rank 0, and in a process that has joined no process group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def destroy_distributed() -> None:
    global _STATE
    _STATE = None
    disable_one_shot()
    if dist.is_initialized():
        dist.destroy_process_group()
