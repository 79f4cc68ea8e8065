"""Project an 8-GPU node's serving speed from one simulated rank's raw output (`size_rank.py`) and a committed
latency table (`configs/node_latency.json`, every figure with its source; nothing is typed in here).

Per layout (one raw file each: TP 8, DP 8 x EP 8, SP on / off), per MTP k and per concurrency of the table's
workload (8k in / 1k out):

- the node's decode step = the busiest rank's measured step (the raw file's load; `--load busiest` is the
  default of size_rank), minus the simulation's stand-ins (the fill copies of its all-gathers and
  reduce-scatters: a launch each plus their bytes read and written at HBM bandwidth), plus every counted
  collective at the latency of its path and bytes on the real group, plus the host work the simulation cannot
  see (DP > 1: the table's measured figure, or "not measured");
- two columns: optimistic (one-shot calls at the one-shot latency by size, NCCL calls at NCCL's) and
  pessimistic (every call as NCCL in a CUDA graph, never below the project's measured 15 us);
- latency by size: linear from the project's small-message figure at 0 bytes to the published by-size table,
  then along it, past it by its last slope, and never below the bus-bandwidth time of the bytes;
- the rank runs ceil(C / dp) sequences; a step at that batch is interpolated between measured batches (same
  context, the one nearest the workload's mean context), never extrapolated; depth is the config's full
  depth, measured or extrapolated linearly from two measured depths (labelled);
- TPOT = node step / acceptance length (k = 0: 1); a request's lifetime on its DP group =
  output / acceptance steps + its group's prompts (one prefill of the input per request);
  output tok/s per GPU = dp x batch x output / lifetime / GPUs;
- KV: a layout fits when its DP group's sequences (input + output + k tokens each) fit the rank's capacity at
  full depth; otherwise the row says it does not fit.

    python benchmarks/project_node.py tp8_spoff.json tp8_spon.json dp8.json --out projection.md
"""

import argparse
import bisect
import json
import math
from pathlib import Path

TABLE = Path(__file__).parent / "configs" / "node_latency.json"
COLUMNS = ("optimistic", "pessimistic")


class Latency:
    """Microseconds of one collective call on the real group, per column, from the latency table."""

    def __init__(self, table: dict):
        self.world = table["world"]
        published = table["published_by_size"]
        self.sizes = published["bytes"]
        lo_one_shot, _ = table["one_shot_us"]["value"]
        lo_nccl, hi_nccl = table["nccl_in_graph_us"]["value"]
        self.curves = {
            "one_shot": (lo_one_shot, published["one_shot_us"]),
            "nccl": (lo_nccl, published["nccl_us"]),
            "pessimistic": (hi_nccl, published["nccl_us"]),
        }
        self.pessimistic_floor = hi_nccl
        self.bus = table["nccl_bus_bandwidth_gbs"]["value"] * 1e3  # bytes per microsecond

    def _curve(self, name: str, nbytes: float) -> float:
        at_zero, values = self.curves[name]
        sizes = self.sizes
        if nbytes <= sizes[0]:
            return at_zero + (values[0] - at_zero) * nbytes / sizes[0]
        i = min(bisect.bisect_left(sizes, nbytes), len(sizes) - 1)
        slope = (values[i] - values[i - 1]) / (sizes[i] - sizes[i - 1])
        return values[i - 1] + slope * (nbytes - sizes[i - 1])

    def _wire(self, kind: str, nbytes: float) -> float:
        """The bus-bandwidth time of a call: all-reduce moves 2 (w - 1) / w of its bytes, the others (w - 1) / w."""
        share = (self.world - 1) / self.world * (2 if kind == "all_reduce" else 1)
        return nbytes * share / self.bus

    def __call__(self, column: str, kind: str, path: str, nbytes: float) -> float:
        if column == "pessimistic":
            curve = max(self.pessimistic_floor, self._curve("pessimistic", nbytes))
        else:
            curve = self._curve("one_shot" if path.startswith("one_shot") else "nccl", nbytes)
        return max(curve, self._wire(kind, nbytes))


def collectives_us(rows: list[dict], latency: Latency, column: str) -> float:
    """Every counted call of `rows` (size_rank's collectives: kind, path, count, bytes) at its latency."""
    return sum(
        r["count"] * latency(column, r["kind"], r["path"], r["bytes"] / r["count"])
        for r in rows
        if r["count"]
    )


def standin_us(rows: list[dict], table: dict, world: int) -> float:
    """The simulated rank's fill copies: one per simulated all-gather (its output's bytes) and reduce-scatter
    (its block's bytes), a launch each plus the bytes read and written at HBM bandwidth."""
    launch = table["standin_launch_us"]["value"]
    bandwidth = table["hbm_bandwidth_gbs"]["value"] * 1e3  # bytes per microsecond
    total = 0.0
    for r in rows:
        if r["kind"] in ("all_gather", "reduce_scatter"):
            copied = r["bytes"] / (world if r["kind"] == "reduce_scatter" else 1)
            total += r["count"] * launch + 2 * copied / bandwidth
    return total


def full_depth_cases(raw: dict) -> tuple[list[dict], list[dict], dict, str]:
    """The decode cases and prefills at the config's full depth: measured, or extrapolated linearly from the two
    deepest measured depths (times, collective counts and bytes) -> (decode cases, prefills, the deepest
    record (its weights and KV are projected to full depth already), how)."""
    records = {r["layers"]: r for r in raw["records"]}
    full = raw["full_layers"]
    if full in records:
        r = records[full]
        return r["decode"], r["prefill"], r, f"measured at {full} layers"
    if len(records) < 2:
        raise ValueError(
            f"{raw['_path']}: measured at {sorted(records)} layers only; the full depth {full} needs it "
            f"measured, or two depths to extrapolate from"
        )
    l1, l2 = sorted(records)[-2:]
    a, b = records[l1], records[l2]

    def scale(v1: float, v2: float) -> float:
        return v1 + (v2 - v1) * (full - l1) / (l2 - l1)

    def merge(x: dict, y: dict) -> dict:
        out = dict(y)
        for key in ("target_ms", "drafter_ms", "step_ms", "ms", "floor_ms"):
            if key in x:
                out[key] = scale(x[key], y[key])
        for key in ("collectives", "drafter_collectives"):
            if key in x:
                shallow = {(r["kind"], r["path"]): r for r in x[key]}
                out[key] = []
                for r in y[key]:
                    s = shallow.get((r["kind"], r["path"]), {"count": 0, "bytes": 0})
                    count = round(scale(s["count"], r["count"]))
                    out[key].append({**r, "count": count, "bytes": scale(s["bytes"], r["bytes"])})
        return out

    decode = [merge(x, y) for x, y in zip(a["decode"], b["decode"])]
    prefill = [merge(x, y) for x, y in zip(a["prefill"], b["prefill"])]
    return decode, prefill, b, f"extrapolated to {full} layers from {l1} and {l2}"


def node_step_ms(case: dict, latency: Latency, table: dict, column: str, host_us: float) -> float:
    rows = case["collectives"] + case.get("drafter_collectives", [])
    step_us = case["step_ms"] * 1e3 - standin_us(rows, table, latency.world)
    return (step_us + collectives_us(rows, latency, column) + host_us) / 1e3


def step_at_batch(cases: list[dict], batch: int, context: int, k: int, fn) -> float | None:
    """fn(case) at `batch` sequences: measured, or linear between the measured batches around it (same
    context and k); None outside them."""
    same = sorted((c["batch"], fn(c)) for c in cases if c["context"] == context and c["mtp_k"] == k)
    for (b1, v1), (b2, v2) in zip(same, same[1:]):
        if b1 <= batch <= b2:
            return v1 + (v2 - v1) * (batch - b1) / (b2 - b1) if b2 > b1 else v1
    return next((v for b, v in same if b == batch), None)


def project(raws: list[dict], table: dict) -> list[dict]:
    """Every (layout, k, concurrency, column) row of the projection."""
    latency, work = Latency(table), table["workload"]
    accept = {int(k): v for k, v in table["mtp_acceptance_length"]["value"].items()}
    rows = []
    for raw in raws:
        decode, prefill, record, depth = full_depth_cases(raw)
        dp = raw["dp"]
        host = table["host_us_per_step"]["value"]["dp1" if dp == 1 else "dp"]
        capacity = record["kv"]["rank_tokens_full_depth"]
        contexts = sorted({c["context"] for c in decode})
        mean_context = work["input_tokens"] + work["output_tokens"] // 2
        context = min(contexts, key=lambda c: abs(c - mean_context))
        fill = next((p for p in prefill if p["tokens"] == work["input_tokens"] and "ms" in p), None)
        for k in sorted({c["mtp_k"] for c in decode}):
            a = 1.0 if k == 0 else accept.get(k)
            for concurrency in work["concurrency"]:
                batch = math.ceil(concurrency / dp)
                need = batch * (work["input_tokens"] + work["output_tokens"] + k)
                base = {
                    "layout": f"tp{raw['tp']} x dp{dp}",
                    "sp": raw["sp"],
                    "mtp_k": k,
                    "acceptance": a,
                    "concurrency": concurrency,
                    "batch_per_rank": batch,
                    "context": context,
                    "depth": depth,
                    "load": raw["load"],
                    "kv_tokens_needed": need,
                    "kv_tokens_held": capacity,
                }
                for column in COLUMNS:
                    row = {**base, "column": column}
                    rows.append(row)
                    if capacity is not None and need > capacity:
                        row["result"] = "does not fit the KV cache"
                        continue
                    if host is None:
                        row["result"] = "host work per step not measured"
                        continue
                    if a is None:
                        row["result"] = f"no acceptance length for k = {k}"
                        continue
                    step = step_at_batch(
                        decode,
                        batch,
                        context,
                        k,
                        lambda c: node_step_ms(c, latency, table, column, host),
                    )
                    if step is None or fill is None:
                        row["result"] = "not measured (batch or prefill)"
                        continue
                    fill_ms = node_step_ms(
                        {**fill, "step_ms": fill["ms"]}, latency, table, column, 0
                    )
                    lifetime_ms = work["output_tokens"] / a * step + batch * fill_ms
                    row.update(
                        result="ok",
                        node_step_ms=step,
                        tpot_ms=step / a,
                        prefill_ms=fill_ms,
                        tok_s_per_gpu=dp
                        * batch
                        * work["output_tokens"]
                        / (lifetime_ms / 1e3)
                        / work["gpus"],
                    )
    return rows


def render(rows: list[dict], table: dict) -> str:
    lines = [
        "| layout | SP | k | concurrency | column | node step ms | TPOT ms | tok/s per GPU | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = r["result"] == "ok"
        lines.append(
            f"| {r['layout']} | {r['sp']} | {r['mtp_k']} | {r['concurrency']} | {r['column']} | "
            + (
                f"{r['node_step_ms']:.2f} | {r['tpot_ms']:.2f} | {r['tok_s_per_gpu']:.1f} |"
                if ok
                else "- | - | - |"
            )
            + f" {r['depth']}; {r['result']} |"
        )
    lines += ["", "Published (8 x H200, GLM-5.2-FP8; " + table["peers"]["source"] + "):", ""]
    lines += ["| who | concurrency | tok/s per GPU | TPOT ms |", "|---|---|---|---|"]
    for p in table["peers"]["rows"]:
        per_gpu = p.get("tok_s_per_gpu") or (
            p["tok_s_node"] / table["workload"]["gpus"] if "tok_s_node" in p else None
        )
        lines.append(
            f"| {p['who']} | {p['concurrency']} | {'-' if per_gpu is None else f'{per_gpu:.1f}'} | "
            f"{p.get('tpot_ms') or '-'} |"
        )
    best = {}
    for r in rows:
        if r["result"] == "ok":
            key = (r["concurrency"], r["column"])
            if key not in best or r["tok_s_per_gpu"] > best[key]["tok_s_per_gpu"]:
                best[key] = r
    lines += ["", "Best layout per concurrency:", ""]
    for (concurrency, column), r in sorted(best.items()):
        lines.append(
            f"- {concurrency} concurrent, {column}: {r['layout']} SP {r['sp']} k = {r['mtp_k']} "
            f"({r['tok_s_per_gpu']:.1f} tok/s per GPU, TPOT {r['tpot_ms']:.2f} ms)"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("raw", nargs="+", help="size_rank.py outputs, one per layout")
    p.add_argument("--table", default=str(TABLE))
    p.add_argument("--out", help="the projection, Markdown (a .json beside it holds every row)")
    opts = p.parse_args(argv)
    table = json.loads(Path(opts.table).read_text())
    raws = [{**json.loads(Path(path).read_text()), "_path": path} for path in opts.raw]
    rows = project(raws, table)
    text = render(rows, table)
    if opts.out:
        Path(opts.out).write_text(text + "\n")
        Path(opts.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(text)
    return rows


if __name__ == "__main__":
    main()
