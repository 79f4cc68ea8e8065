"""`spmoe serve` as one rank of the node serves it: GLM-5.2's config (`configs/glm-5.2`, any depth), FP8
dummy weights, rank 0 of TP 8 / EP 8 run for real with the other ranks simulated (`--simulate-rank`,
a measurement mode: outputs are not the model's), the server's own defaults for everything else
(graphs up to 256 sequences, the whole context, warm before ready). Then `bench_serve.py` loads it.

It reports: seconds from launch to ready, the server's warm-up line (kernel variants, graphs, seconds),
its KV cache line, the GPU memory in use once ready (`nvidia-smi`), the load's table, and the
compiles and graph captures after ready (`/metrics`: the goal is none). JSON to `--out`.

The checkpoint folder holds the config and the demo's byte-level tokenizer widened to GLM-5.2's
154,880 ids (`bench_serve_vs_generate.widen_tokenizer`), so prompts are random ids and the text is
" w<id>" tokens.

    python benchmarks/serve_simulated_rank.py --layers 78 --concurrency 64 256 --num-prompts 256 \\
        --input-len 1024 --output-len 128 --out rank_serve.json -- --kv-cache-dtype fp8 \\
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'
"""

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_serve_vs_generate import widen_tokenizer
from size_rank import CONFIG, depth_overrides

from spmoe.distributed.launcher import free_port
from spmoe.entrypoints.demo import write_demo_tokenizer

AFTER_READY = ("compiles_after_ready", "cuda_graph_captures", "kernel_compiles", "engine_steps")


def write_folder(folder: Path, layers: int) -> None:
    """GLM-5.2's config cut to `layers` layers, and a tokenizer with a token for each of its ids."""
    raw = json.loads(CONFIG.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw | depth_overrides(raw, layers), indent=1))
    write_demo_tokenizer(folder)
    widen_tokenizer(folder, raw["vocab_size"])


def counters(base: str) -> dict[str, float]:
    """The engine's own counters in /metrics (`spmoe:NAME_total`, summed over label sets)."""
    import httpx

    text = httpx.get(base + "/metrics", timeout=30).text
    found = {}
    for name in AFTER_READY:
        values = re.findall(rf"^spmoe:{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M)
        if not values:
            raise RuntimeError(f"/metrics has no spmoe:{name}_total")
        found[name] = sum(float(v) for v in values)
    return found


def gpu_memory_mib() -> list[int]:
    """MiB in use on each GPU, from nvidia-smi ([] where there is none)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [int(line) for line in out.split()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--folder", type=Path, default=Path("/tmp/glm-5.2-rank"))
    p.add_argument("--layers", type=int, default=78)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for ready")
    p.add_argument("--out", type=Path, required=True, help="the raw output, JSON")
    args, rest = p.parse_known_args()
    rest = [a for a in rest if a != "--"]
    write_folder(args.folder, args.layers)
    port = free_port()
    command = [
        *(sys.executable, "-m", "spmoe", "serve", str(args.folder), "--port", str(port)),
        *("--load-format", "dummy", "--simulate-rank", "-tp", str(args.tp)),
        *("--enable-expert-parallel", *rest),
    ]
    print("+ " + " ".join(command), flush=True)
    began = time.monotonic()
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    record, ready = {"command": command, "layers": args.layers, "log": []}, threading.Event()

    def drain():  # the server's log, kept and echoed all along (a full pipe would stall it)
        for line in server.stderr:
            print(line, end="", file=sys.stderr, flush=True)
            record["log"].append(line.rstrip())
            if "ready: " in line:
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        while not ready.wait(1):
            if server.poll() is not None:
                raise RuntimeError(
                    f"spmoe serve exited with {server.returncode} before it was ready"
                )
            if time.monotonic() - began > args.ready_timeout:
                raise RuntimeError(f"not ready after {args.ready_timeout:.0f} s")
        record["ready_s"] = time.monotonic() - began
        record["gpu_memory_mib_ready"] = gpu_memory_mib()
        base = f"http://127.0.0.1:{port}"
        record["at_ready"] = counters(base)
        print(
            f"ready after {record['ready_s']:.1f} s, GPU memory {record['gpu_memory_mib_ready']} MiB"
        )
        bench = [
            *(sys.executable, str(Path(__file__).with_name("bench_serve.py"))),
            *("--base-url", base + "/v1", "--num-prompts", str(args.num_prompts)),
            *("--input-len", str(args.input_len), "--output-len", str(args.output_len)),
            *("--concurrency", *map(str, args.concurrency)),
            *("--json", str(args.folder / "bench_serve.json")),
        ]
        subprocess.run(bench, check=True)
        record["bench"] = json.loads((args.folder / "bench_serve.json").read_text())
        record["after_load"] = counters(base)
        record["gpu_memory_mib_after"] = gpu_memory_mib()
        after = {k: record["after_load"][k] - record["at_ready"][k] for k in AFTER_READY}
        print(f"during the load: {json.dumps(after)}")
    finally:
        args.out.write_text(json.dumps(record, indent=1))
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
