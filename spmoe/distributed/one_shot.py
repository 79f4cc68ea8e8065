"""One-shot collectives for small messages between GPUs that reach each other over NVLink: one Triton kernel
per call on a torch symmetric-memory buffer, capturable in a CUDA graph. NCCL does everything else.

Every rank of a group allocates the same buffer and signal pad (torch symmetric memory maps every peer's
buffer into each rank's address space). One call is one kernel of P programs on every rank:

1. push: program p writes its chunks of what rank j needs (all-gather, all-reduce: the input; reduce-scatter:
   block j of it) into row `rank` of rank j's buffer, for every j, over NVLink;
2. barrier: program p flags program p of every peer that its chunks are there, then waits for theirs;
3. combine, from local memory: program p writes its chunks of the output (all-gather: the WORLD rows in
   place; reduce-scatter and all-reduce: their float32 sum in rank order, so every rank gets the same bits);
4. barrier again, so that no rank pushes the next call's rows while a peer still reads this call's.

`all_reduce_add_rms_norm` is the all-reduce with the residual add and RMSNorm of the sum fused into step 3: one
kernel per row block instead of an all-reduce and an add-norm (program p owns rows p, p + P, ...).

Program p only waits for program p of a peer, and P is at most the number of SMs, so every program is
resident and the waits always end. The waiter resets each flag, so the pad is clean after every call, graph
replays included. NVLink multicast is never used.
"""

import torch

MAX_PROGRAMS = 32  # also the flag slots per phase in the signal pad
BLOCK = 2048  # elements per program per step
BUFFER_BYTES = 8 << 20  # per rank: WORLD rows of one call's per-rank block

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the one-shot path is simply unavailable
    triton = None

if triton is not None:
    @triton.jit
    def _barrier(pads, pid, phase: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, PROGRAMS: tl.constexpr):
        """Program `pid` of every rank meets program `pid` of every other rank (PROGRAMS flag slots per phase)."""
        tl.debug_barrier()  # this program's threads are done with their loads and stores
        slot = (phase * PROGRAMS + pid) * WORLD
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                flag = tl.load(pads + peer).to(tl.pointer_type(tl.int32)) + slot + RANK
                while tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0:
                    pass
        own = tl.load(pads + RANK).to(tl.pointer_type(tl.int32)) + slot
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                while tl.atomic_cas(own + peer, 1, 0, sem="acquire", scope="sys") != 1:
                    pass
        tl.debug_barrier()

    @triton.jit
    def _one_shot_kernel(x_ptr, out_ptr, buffers, pads, numel, KIND: tl.constexpr, RANK: tl.constexpr,
                         WORLD: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        """KIND 0 all-gather: x `[numel]` -> out `[WORLD * numel]`; 1 reduce-scatter: x `[WORLD * numel]` ->
        out `[numel]`, block RANK of the sum; 2 all-reduce: x `[numel]` -> out `[numel]`, the sum.
        Every rank's buffer holds `[WORLD, numel]`: row j is what rank j sent it."""
        pid, step = tl.program_id(0), tl.num_programs(0) * BLOCK
        dtype = x_ptr.dtype.element_ty
        for start in range(pid * BLOCK, numel, step):  # push this rank's rows into every rank's buffer
            offs = start + tl.arange(0, BLOCK)
            mask = offs < numel
            if KIND != 1:
                rows = tl.load(x_ptr + offs, mask=mask)
            for j in tl.static_range(WORLD):
                if KIND == 1:  # rank j gets block j
                    rows = tl.load(x_ptr + j * numel + offs, mask=mask)
                peer = tl.load(buffers + j).to(tl.pointer_type(dtype))
                tl.store(peer + RANK * numel + offs, rows, mask=mask)
        _barrier(pads, pid, 0, RANK, WORLD, PROGRAMS)
        own = tl.load(buffers + RANK).to(tl.pointer_type(dtype))
        for start in range(pid * BLOCK, numel, step):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < numel
            if KIND == 0:
                for j in tl.static_range(WORLD):
                    tl.store(out_ptr + j * numel + offs, tl.load(own + j * numel + offs, mask=mask, volatile=True),
                             mask=mask)
            else:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for j in tl.static_range(WORLD):
                    acc += tl.load(own + j * numel + offs, mask=mask, volatile=True).to(tl.float32)
                tl.store(out_ptr + offs, acc.to(dtype), mask=mask)
        _barrier(pads, pid, 1, RANK, WORLD, PROGRAMS)  # before any rank pushes the next call's rows here

    @triton.jit
    def _one_shot_add_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buffers, pads, rows, size, eps,
                                  HAS_RESIDUAL: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                                  BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        """x `[rows, size]` this rank's partial sum, res `[rows, size]` -> res_out = sum over ranks (rounded
        to the dtype, as the all-reduce) + res, out = RMSNorm(res_out) * w, rounded as `RMSNorm.add_norm`."""
        pid, programs = tl.program_id(0), tl.num_programs(0)
        dtype = x_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK)
        mask = cols < size
        numel = rows * size
        for row in range(pid, rows, programs):  # push this rank's rows into every rank's buffer
            values = tl.load(x_ptr + row * size + cols, mask=mask)
            for j in tl.static_range(WORLD):
                peer = tl.load(buffers + j).to(tl.pointer_type(dtype))
                tl.store(peer + RANK * numel + row * size + cols, values, mask=mask)
        _barrier(pads, pid, 0, RANK, WORLD, PROGRAMS)
        own = tl.load(buffers + RANK).to(tl.pointer_type(dtype))
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        for row in range(pid, rows, programs):
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for j in tl.static_range(WORLD):
                acc += tl.load(own + j * numel + row * size + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
            x = acc.to(dtype)
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + tl.load(res_ptr + row * size + cols, mask=mask, other=0.0).to(tl.float32))
                x = x.to(dtype)
            tl.store(res_out_ptr + row * size + cols, x, mask=mask)
            xf = x.to(tl.float32)
            normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / size + eps)).to(dtype).to(tl.float32)
            tl.store(out_ptr + row * size + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)
        _barrier(pads, pid, 1, RANK, WORLD, PROGRAMS)


KINDS = {"all_gather": 0, "reduce_scatter": 1, "all_reduce": 2}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class OneShot:
    """The symmetric buffer and signal pad of one process group, and the one-shot calls on it."""

    def __init__(self, group, device: torch.device):
        """Collective over `group`: every member must construct it at the same point."""
        import torch.distributed._symmetric_memory as symm_mem

        if triton is None:
            raise RuntimeError("triton is not installed")
        self.buffer = symm_mem.empty(BUFFER_BYTES, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.rank, self.world = handle.rank, handle.world_size
        needed = 2 * MAX_PROGRAMS * self.world * 4
        if handle.signal_pad_size < needed:
            raise RuntimeError(f"the signal pad holds {handle.signal_pad_size} bytes, the kernel needs {needed}")
        self.buffers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.pads = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        self.handle = handle  # keeps the mapping alive

    def buffer_bytes(self, kind: str, x: torch.Tensor) -> int:
        """Buffer bytes per rank a `kind` call on input `x` takes: WORLD per-rank blocks."""
        return x.numel() * x.element_size() * (1 if kind == "reduce_scatter" else self.world)

    def fits(self, kind: str, x: torch.Tensor, max_bytes: int = BUFFER_BYTES) -> bool:
        """Whether a `kind` call may take `x`: on a GPU, a dtype it sums, and within `max_bytes` of buffer."""
        return x.dtype in DTYPES and x.is_cuda and self.buffer_bytes(kind, x) <= min(max_bytes, BUFFER_BYTES)

    def run(self, kind: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (contiguous) <- the `kind` collective of `x` (contiguous) over the group."""
        if self.buffer_bytes(kind, x) > BUFFER_BYTES:
            raise ValueError(f"one-shot {kind} of {tuple(x.shape)} {x.dtype} needs {self.buffer_bytes(kind, x)} "
                             f"buffer bytes per rank, the buffer has {BUFFER_BYTES}")
        numel = out.numel() if kind != "all_gather" else x.numel()
        programs = min(MAX_PROGRAMS, triton.cdiv(numel, BLOCK))
        _one_shot_kernel[(programs,)](x, out, self.buffers, self.pads, numel, KIND=KINDS[kind], RANK=self.rank,
                                      WORLD=self.world, BLOCK=BLOCK, PROGRAMS=MAX_PROGRAMS, num_warps=8)
        return out

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, H]` (contiguous) a partial sum, residual `[N, H]` or None, weight `[H]` -> (RMSNorm(sum + residual)
        in the dtype of weight * x, sum + residual), both `[N, H]`: the all-reduce and `RMSNorm.add_norm` in one
        kernel."""
        if self.buffer_bytes("all_reduce", x) > BUFFER_BYTES:
            raise ValueError(f"one-shot all-reduce of {tuple(x.shape)} {x.dtype} needs "
                             f"{self.buffer_bytes('all_reduce', x)} buffer bytes per rank, the buffer has "
                             f"{BUFFER_BYTES}")
        rows, size = x.shape
        residual = residual.contiguous() if residual is not None else None
        out = torch.empty(rows, size, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        new_residual = torch.empty_like(x)
        if rows:
            block = triton.next_power_of_2(size)
            _one_shot_add_norm_kernel[(min(MAX_PROGRAMS, rows),)](
                x, residual if residual is not None else x, weight, out, new_residual, self.buffers, self.pads, rows,
                size, eps, HAS_RESIDUAL=residual is not None, RANK=self.rank, WORLD=self.world, BLOCK=block,
                PROGRAMS=MAX_PROGRAMS, num_warps=min(16, max(1, block // 512)))
        return out, new_residual
