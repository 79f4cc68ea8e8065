"""One-shot collectives for small messages between GPUs that reach each other over NVLink: one
Triton kernel per call on a torch symmetric-memory buffer, capturable in a CUDA graph. NCCL does
everything else.

Every rank of a group allocates the same buffer and signal pad (torch symmetric memory maps every
peer's buffer into each rank's address space). One call is one kernel of P programs on every rank:

1. push: program p writes its chunks of what rank j needs (all-gather, all-reduce: the input;
   reduce-scatter: block j of it) into row `rank` of rank j's buffer, for every j, over NVLink;
2. barrier: program p flags program p of every peer that its chunks are there, then
   waits for theirs;
3. combine, from local memory: program p writes its chunks of the output (all-gather: the WORLD rows
   in place; reduce-scatter and all-reduce: their float32 sum in rank order, so every rank gets
   the same bits);
4. barrier again, so that no rank pushes the next call's rows while a peer still reads this call's.

`OneShot.add_rms_norm` fuses a collective with the residual add and RMSNorm that follow or precede
it, so that a layout transition of the layer plan is one kernel (program p owns rows p, p + P, ...
of its rank's block): all-reduce and reduce-scatter norm the summed rows in step 3; all-gather norms
this rank's rows before step 1 and pushes the normed rows.

Program p only waits for program p of a peer, and P is at most the number of SMs, so every program
is resident and the waits always end. The waiter resets each flag, so the pad is clean after every
call, graph replays included. NVLink multicast is never used.

Offsets stay 32-bit on purpose: `run` and `add_rms_norm` refuse any call whose WORLD blocks exceed
`BUFFER_BYTES` (8 MiB), so no index into x, out or a buffer reaches 2**31.
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
    def _barrier(
        pads,
        pid,
        phase: tl.constexpr,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        """Program `pid` of every rank meets program `pid` of every other rank (PROGRAMS flag
        slots per phase)."""
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
    def _one_shot_kernel(
        x_ptr,
        out_ptr,
        buffers,
        pads,
        numel,
        KIND: tl.constexpr,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        BLOCK: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        """KIND 0 all-gather: x `[numel]` -> out `[WORLD * numel]`; 1 reduce-scatter: x
        `[WORLD * numel]` -> out `[numel]`, block RANK of the sum; 2 all-reduce: x `[numel]` -> out
        `[numel]`, the sum. Every rank's buffer holds `[WORLD, numel]`: row j is what
        rank j sent it."""
        pid, step = tl.program_id(0), tl.num_programs(0) * BLOCK
        dtype = x_ptr.dtype.element_ty
        # push this rank's rows into every rank's buffer
        for start in range(pid * BLOCK, numel, step):
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
                    tl.store(
                        out_ptr + j * numel + offs,
                        tl.load(own + j * numel + offs, mask=mask, volatile=True),
                        mask=mask,
                    )
            else:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for j in tl.static_range(WORLD):
                    acc += tl.load(own + j * numel + offs, mask=mask, volatile=True).to(tl.float32)
                tl.store(out_ptr + offs, acc.to(dtype), mask=mask)
        # before any rank pushes the next call's rows here
        _barrier(pads, pid, 1, RANK, WORLD, PROGRAMS)

    @triton.jit
    def _add_rms_norm_row(
        x,
        row,
        res_ptr,
        w,
        out_ptr,
        res_out_ptr,
        cols,
        mask,
        out_mask,
        size,
        eps,
        HAS_RESIDUAL: tl.constexpr,
    ):
        """One row x `[BLOCK]` (the tensor dtype): res_out[row] = x + res[row], out[row] =
        RMSNorm(that) * w (where `out_mask`), rounded as `RMSNorm.add_norm`. Returns the normed row
        (out's dtype)."""
        dtype = x.dtype
        if HAS_RESIDUAL:
            x = x.to(tl.float32) + tl.load(res_ptr + row * size + cols, mask=mask, other=0.0).to(
                tl.float32
            )
            x = x.to(dtype)
        tl.store(res_out_ptr + row * size + cols, x, mask=mask)
        xf = x.to(tl.float32)
        normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / size + eps)).to(dtype).to(tl.float32)
        normed = (w * normed).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * size + cols, normed, mask=out_mask)
        return normed

    @triton.jit
    def _one_shot_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        buffers,
        pads,
        rows,
        valid,
        size,
        eps,
        KIND: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        BLOCK: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        """A collective fused with the residual add and RMSNorm; `rows` are the rows
        each rank norms:

        KIND 2 all-reduce: x `[rows, size]` partial sum -> res_out = sum + res, out = norm(res_out),
        `[rows, size]`. KIND 1 reduce-scatter: x `[valid, size]` partial sum (rows
        `valid .. WORLD * rows` are zero pad) -> block
            RANK of the sum + res, and its norm, `[rows, size]`.
        KIND 0 all-gather: x, res `[rows, size]` this rank's shard -> res_out = x + res
        `[rows, size]`, and out
            `[valid, size]`: the first `valid` of every rank's normed rows, in rank order.
        Every rank's buffer holds `[WORLD, block]`: row j is what rank j sent it."""
        pid, programs = tl.program_id(0), tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < size
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        block = rows * size  # elements each rank sends each peer
        for row in range(pid, rows, programs):  # push this rank's rows into every rank's buffer
            if KIND == 0:
                values = tl.load(x_ptr + row * size + cols, mask=mask)
                values = _add_rms_norm_row(
                    values,
                    row,
                    res_ptr,
                    w,
                    out_ptr + RANK * block,
                    res_out_ptr,
                    cols,
                    mask,
                    cols < tl.where(RANK * rows + row < valid, size, 0),
                    size,
                    eps,
                    HAS_RESIDUAL,
                )
            elif KIND == 2:
                values = tl.load(x_ptr + row * size + cols, mask=mask)
            for j in tl.static_range(WORLD):
                if KIND == 1:  # rank j gets rows j * rows + row; those from `valid` on are zero pad
                    real = cols < tl.where(j * rows + row < valid, size, 0)
                    values = tl.load(x_ptr + (j * rows + row) * size + cols, mask=real, other=0.0)
                peer = tl.load(buffers + j).to(tl.pointer_type(values.dtype))
                tl.store(peer + RANK * block + row * size + cols, values, mask=mask)
        _barrier(pads, pid, 0, RANK, WORLD, PROGRAMS)
        for row in range(pid, rows, programs):
            # the peers' normed rows (this rank's own were written above), up to `valid`
            if KIND == 0:
                own = tl.load(buffers + RANK).to(tl.pointer_type(out_ptr.dtype.element_ty))
                for j in tl.static_range(WORLD):
                    if j != RANK:
                        tl.store(
                            out_ptr + (j * rows + row) * size + cols,
                            tl.load(own + j * block + row * size + cols, mask=mask, volatile=True),
                            mask=cols < tl.where(j * rows + row < valid, size, 0),
                        )
            else:
                own = tl.load(buffers + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty))
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for j in tl.static_range(WORLD):
                    acc += tl.load(
                        own + j * block + row * size + cols, mask=mask, other=0.0, volatile=True
                    ).to(tl.float32)
                _add_rms_norm_row(
                    acc.to(x_ptr.dtype.element_ty),
                    row,
                    res_ptr,
                    w,
                    out_ptr,
                    res_out_ptr,
                    cols,
                    mask,
                    mask,
                    size,
                    eps,
                    HAS_RESIDUAL,
                )
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
            raise RuntimeError(
                f"the signal pad holds {handle.signal_pad_size} bytes, the kernel needs {needed}"
            )
        self.buffers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.pads = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        self.handle = handle  # keeps the mapping alive

    def buffer_bytes(self, kind: str, x: torch.Tensor) -> int:
        """Buffer bytes per rank a `kind` call on input `x` takes: WORLD per-rank blocks."""
        return x.numel() * x.element_size() * (1 if kind == "reduce_scatter" else self.world)

    def fits(self, kind: str, x: torch.Tensor, max_bytes: int = BUFFER_BYTES) -> bool:
        """Whether a `kind` call may take `x`: on a GPU, a dtype it sums, and within
        `max_bytes` of buffer."""
        return (
            x.dtype in DTYPES
            and x.is_cuda
            and self.buffer_bytes(kind, x) <= min(max_bytes, BUFFER_BYTES)
        )

    def run(self, kind: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (contiguous) <- the `kind` collective of `x` (contiguous) over the group."""
        if self.buffer_bytes(kind, x) > BUFFER_BYTES:
            raise ValueError(
                f"one-shot {kind} of {tuple(x.shape)} {x.dtype} needs {self.buffer_bytes(kind, x)} "
                f"buffer bytes per rank, the buffer has {BUFFER_BYTES}"
            )
        numel = out.numel() if kind != "all_gather" else x.numel()
        programs = min(MAX_PROGRAMS, triton.cdiv(numel, BLOCK))
        _one_shot_kernel[(programs,)](
            x,
            out,
            self.buffers,
            self.pads,
            numel,
            KIND=KINDS[kind],
            RANK=self.rank,
            WORLD=self.world,
            BLOCK=BLOCK,
            PROGRAMS=MAX_PROGRAMS,
            num_warps=8,
        )
        return out

    def norm_rows(self, kind: str, num_tokens: int) -> int:
        """Rows each rank norms in an `add_rms_norm` of N = num_tokens: N for all_reduce, else
        ceil(N / WORLD)."""
        return num_tokens if kind == "all_reduce" else -(-num_tokens // self.world)

    def add_rms_norm(
        self,
        kind: str,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        num_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `kind` collective fused with `RMSNorm.add_norm` (weight `[H]`) -> (normed, new
        residual), N tokens, n = ceil(N / WORLD) rows per rank:

        - all_reduce: x `[N, H]` partial sum, residual `[N, H]` -> both `[N, H]`;
        - reduce_scatter: x `[N, H]` partial sum, residual `[n, H]` (this rank's rows)
          -> both `[n, H]`;
        - all_gather: x, residual `[n, H]` this rank's rows -> normed `[N, H]` (all ranks'), new
          residual `[n, H]`.
        A missing residual counts as zero. The normed rows are in the dtype of weight * x."""
        rows, size = self.norm_rows(kind, num_tokens), x.shape[1]
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
        needed = (
            self.world * rows * size * (out_dtype if kind == "all_gather" else x.dtype).itemsize
        )
        if needed > BUFFER_BYTES:
            raise ValueError(
                f"one-shot {kind} + RMSNorm of {tuple(x.shape)} {x.dtype} needs {needed} buffer "
                f"bytes per rank, the buffer has {BUFFER_BYTES}"
            )
        x = x.contiguous()
        residual = residual.contiguous() if residual is not None else None
        out_rows = num_tokens if kind == "all_gather" else rows
        out = torch.empty(out_rows, size, dtype=out_dtype, device=x.device)
        new_residual = torch.empty(rows, size, dtype=x.dtype, device=x.device)
        if rows:
            block = triton.next_power_of_2(size)
            _one_shot_norm_kernel[(min(MAX_PROGRAMS, rows),)](
                x,
                residual if residual is not None else x,
                weight,
                out,
                new_residual,
                self.buffers,
                self.pads,
                rows,
                num_tokens,
                size,
                eps,
                KIND=KINDS[kind],
                HAS_RESIDUAL=residual is not None,
                RANK=self.rank,
                WORLD=self.world,
                BLOCK=block,
                PROGRAMS=MAX_PROGRAMS,
                num_warps=min(16, max(1, block // 512)),
            )
        return out, new_residual
