"""The same batch through `spmoe generate` and through `spmoe serve` + `bench_serve.py`: is the front end the
bottleneck? (Goal: served output tokens/s within 10% of generate's.) With several `--concurrency` values, one
run of each per value, and a table at the end.

Writes a GLM-5.2-wide checkpoint with the demo's byte-level tokenizer (2 layers: 1 dense + 1 MoE of
`--experts` experts top-8, vocab 264, no eos, random weights), then:
1. `spmoe generate` over `--num-prompts` random prompts of `--input-len` tokens, `--output-len` new tokens
   each, `--concurrency` sequences at once (`--max-num-seqs`);
2. `spmoe serve` with `--max-num-seqs = --concurrency`, loaded by `bench_serve.py` at that concurrency with
   the same counts and lengths (`ignore_eos`, so every request generates `--output-len` tokens).
Both run with the options after `--` (e.g. `--device cuda --dtype bfloat16 --cuda-graphs`). Prints both
output token rates (generated tokens / wall time of the batch, prefill included) and their ratio, and, from
the server's /metrics before and after the load, the engine process's time per step on the exchange with the
front end (receiving, decoding, encoding, sending; wall time) and its seconds in all waiting for requests with
nothing to run (the engine never waits while a request is live; this is the time around and between the load's
requests, the bench client's start included).

    python benchmarks/bench_serve_vs_generate.py --folder /tmp/svg --concurrency 1 16 64 256 \
        --num-prompts 512 --input-len 128 --output-len 256 -- --device cuda --dtype bfloat16 --cuda-graphs

On the CPU, `--widths demo` (the demo's small widths) makes the model step cheap enough that the front end's
cost per token shows:

    python benchmarks/bench_serve_vs_generate.py --folder /tmp/svg-demo --widths demo --concurrency 64 \
        --num-prompts 128 --input-len 16 --output-len 64 -- --device cpu

With `--sampling plain processed` it skips generate and runs bench_serve with those settings side by side
(the cost of logprobs and penalties on every sequence): an untimed warm-up run of each, then `--rounds`
rounds of both, the first of the two alternating round by round, and the median of the rounds' processed /
plain ratios. `--vocab-size 154880` gives the checkpoint GLM-5.2's vocabulary, which is what that cost scales
with (the tokenizer gets a token for every id: id i >= 264 is " w<i>"):

    python benchmarks/bench_serve_vs_generate.py --folder /tmp/svg-vocab --vocab-size 154880 --concurrency 64 \
        --num-prompts 128 --input-len 128 --output-len 128 --sampling plain processed --rounds 3 \
        -- --device cuda --dtype bfloat16 --cuda-graphs
"""

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_generate import glm_config

from spmoe.distributed import spawn
from spmoe.distributed.launcher import free_port
from spmoe.entrypoints.demo import CONFIG as DEMO_CONFIG
from spmoe.entrypoints.demo import write_demo_tokenizer
from spmoe.models.deepseek_v32.weights import write_random_checkpoint


def write_checkpoint(folder: Path, experts: int, vocab_size: int, widths: str) -> None:
    """GLM-5.2's widths, or (`widths` "demo") the demo's small ones, for a model step cheap enough on the CPU
    that the front end's cost shows."""
    base = (
        glm_config(2)
        if widths == "glm"
        else DEMO_CONFIG | dict(num_hidden_layers=2, num_nextn_predict_layers=0)
    )
    config = base | dict(
        mlp_layer_types=["dense", "sparse"],
        indexer_types=["full", "full"],
        n_routed_experts=experts,
        vocab_size=vocab_size,
        eos_token_id=[],
        max_position_embeddings=8192,
    )
    if not (folder / "model.safetensors").is_file():
        spawn(write_random_checkpoint, 1, config, folder, 0)
    write_demo_tokenizer(folder)
    widen_tokenizer(folder, vocab_size)


def widen_tokenizer(folder: Path, vocab_size: int) -> None:
    """Give every id of a vocabulary wider than the demo tokenizer's a token of its own: id i >= 264 is the text
    " w<i>". (Without it those ids decode to nothing, and the server sends no text until the end of a request:
    its first chunk comes at the end, and the time per output token looks like none.)"""
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]  # the byte-level characters of bytes 0-255 -> their ids
    byte_char = {b: c for c, b in vocab.items()}
    for token in spec[
        "added_tokens"
    ]:  # in the model's vocabulary too, or they would be given new ids after it
        vocab[token["content"]] = token["id"]
    for i in range(len(vocab), vocab_size):
        vocab["".join(byte_char[b] for b in f" w{i}".encode())] = i
    path.write_text(json.dumps(spec))


def run_generate(folder: Path, args, concurrency: int, rest: list[str]) -> float:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(256) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    (folder / "prompts.json").write_text(json.dumps(prompts))
    out = folder / "generate.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "spmoe",
            "generate",
            "--model",
            str(folder),
            "--tp",
            "1",
            "--input-ids",
            str(folder / "prompts.json"),
            "--max-new-tokens",
            str(args.output_len),
            "--max-num-seqs",
            str(concurrency),
            "--output",
            str(out),
            *rest,
        ],
        check=True,
    )
    stats = json.loads(out.read_text())["stats"]
    print(f"generate: {stats['generated_tokens']} tokens in {stats['seconds']:.2f} s", flush=True)
    return stats["tokens_per_s"]


ENGINE_COUNTERS = ("engine_steps", "engine_exchange_seconds", "engine_idle_seconds")


def engine_counters(base: str) -> dict[str, float]:
    """The engine's step count and its seconds on the exchange and idle, from the server's /metrics."""
    import httpx

    text = httpx.get(base + "/metrics", timeout=30).text
    found = {}
    for name in ENGINE_COUNTERS:
        match = re.search(rf"^spmoe:{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        if match is None:
            raise RuntimeError(f"/metrics has no spmoe:{name}_total")
        found[name] = float(match.group(1))
    return found


def copy_lines(stream) -> None:
    """Print every line of `stream` to our stderr until it ends."""
    for line in stream:
        print(line, end="", file=sys.stderr, flush=True)


def run_serve(folder: Path, args, concurrency: int, rest: list[str]) -> tuple[float, dict]:
    """`spmoe serve` loaded by bench_serve at `concurrency` with `--sampling` -> the median output token rate
    of the timed runs of the first setting (bench_serve's JSON, not its printed table), and the engine's
    steps and seconds on the exchange and idle during the load (warm-up included)."""
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spmoe",
            "serve",
            "--model",
            str(folder),
            "--port",
            str(port),
            "--max-num-seqs",
            str(concurrency),
            "--api-server-count",
            str(args.api_server_count),
            *rest,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in server.stderr:  # wait for the ready line
            print(line, end="", file=sys.stderr)
            if "ready:" in line:
                break
        else:
            raise RuntimeError(f"spmoe serve exited with {server.wait()} before it was ready")
        # the server's log after ready (kernels compiled then, warnings) goes on to ours, and its
        # pipe never fills
        threading.Thread(target=copy_lines, args=(server.stderr,), daemon=True).start()
        before = engine_counters(f"http://127.0.0.1:{port}")
        bench = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("bench_serve.py")),
                "--base-url",
                f"http://127.0.0.1:{port}/v1",
                "--concurrency",
                str(concurrency),
                "--num-prompts",
                str(args.num_prompts),
                "--input-len",
                str(args.input_len),
                "--output-len",
                str(args.output_len),
                "--seed",
                str(args.seed),
                "--sampling",
                *args.sampling,
                "--rounds",
                str(args.rounds),
                *(
                    ("--client-processes", str(args.client_processes))
                    if args.client_processes
                    else ()
                ),
                "--json",
                str(folder / "bench_serve.json"),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        print(bench.stdout, end="", flush=True)
        after = engine_counters(f"http://127.0.0.1:{port}")
        runs = json.loads((folder / "bench_serve.json").read_text())["runs"]
        rate = statistics.median(
            r["out_tok_per_s"]
            for r in runs
            if r["sampling"] == args.sampling[0] and r["round"] != "warm-up"
        )
        return rate, {name: after[name] - before[name] for name in ENGINE_COUNTERS}
    finally:
        server.terminate()
        began = time.monotonic()
        while server.poll() is None and time.monotonic() - began < 30:
            time.sleep(0.2)
        if server.poll() is None:
            server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--folder", type=Path, required=True, help="where the checkpoint is written (reused)"
    )
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vocab-size", type=int, default=264, help="the checkpoint's vocabulary (default 264)"
    )
    parser.add_argument(
        "--widths",
        choices=["glm", "demo"],
        default="glm",
        help="GLM-5.2's (default) or the demo's small widths (for the CPU: the front end's cost per token shows)",
    )
    parser.add_argument(
        "--sampling",
        nargs="+",
        help="only serve, with these bench_serve --sampling settings side by side",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="bench_serve --rounds: timed rounds of the --sampling settings",
    )
    parser.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="the server's front end processes (default 1)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        help="bench_serve --client-processes (default: bench_serve's, one per 32 streams)",
    )
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    write_checkpoint(args.folder, args.experts, args.vocab_size, args.widths)
    if args.sampling:
        for concurrency in args.concurrency:
            run_serve(args.folder, args, concurrency, rest)
        return
    args.sampling = ["plain"]
    rows = []
    for concurrency in args.concurrency:
        generated = run_generate(args.folder, args, concurrency, rest)
        served, engine = run_serve(args.folder, args, concurrency, rest)
        steps = max(engine["engine_steps"], 1)
        rows.append(
            f"| {concurrency} | {generated:.1f} | {served:.1f} | {served / generated:.3f} | "
            f"{engine['engine_steps']:.0f} | {1e3 * engine['engine_exchange_seconds'] / steps:.3f} | "
            f"{engine['engine_idle_seconds']:.2f} |"
        )
    print(
        f"{args.input_len} in -> {args.output_len} out, {args.num_prompts} prompts\n"
        "| streams | generate out tok/s | serve out tok/s | serve / generate | engine steps | "
        "exchange ms/step | idle s |\n|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
