"""MTP acceptance through `spmoe serve` on held-out text: for each k in `--k`, start `spmoe serve` on the
trained demo checkpoint (CPU, TP 1, float32) with `--speculative-config '{"method": "mtp",
"num_speculative_tokens": k}'`, send the held-out prompts the engine's figure uses
(`tests/engine/test_heldout_engine.py`: 4 x 96 bytes from byte 4096, 32 new tokens each, eos ignored) as
one completion request, greedy and then at temperature 1 (seed 5), and read the growth of vLLM's
spec-decode counters in `/metrics` around each: acceptance = accepted / proposed draft tokens
(`...:spec_decode_num_accepted_tokens_total` / `...:spec_decode_num_draft_tokens_total`), mean accepted
length = 1 + accepted / verifications (`...:spec_decode_num_drafts_total`).

    python benchmarks/eval_mtp_serve.py --k 1 2 3
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_serve import server_counters

from spmoe.distributed.launcher import free_port
from spmoe.entrypoints.demo import CHECKPOINT
from spmoe.testing.heldout import heldout_sequences

PROMPTS, PROMPT_LEN, OFFSET, NEW_TOKENS, SEED = 4, 96, 4096, 32, 5


def start(k: int, log: Path) -> tuple[subprocess.Popen, str]:
    """`spmoe serve` with k MTP drafts on a free port, once ready -> (process, base URL)."""
    port = free_port()
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": k})
    command = [sys.executable, "-m", "spmoe", "serve", str(CHECKPOINT)]
    command += ["--tp", "1", "--device", "cpu", "--dtype", "float32", "--port", str(port)]
    command += ["--served-model-name", "tiny", "--speculative-config", spec]
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    while "ready: http://" not in log.read_text():
        if proc.poll() is not None:
            raise RuntimeError(f"spmoe serve exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}"


def acceptance(base: str, prompts: list[list[int]], temperature: float) -> tuple[float, float]:
    """One completion request for all `prompts` -> (acceptance rate, mean accepted length)."""
    before = server_counters(base)
    body = {
        "model": "tiny",
        "prompt": prompts,
        "max_tokens": NEW_TOKENS,
        "temperature": temperature,
        "seed": SEED,
        "ignore_eos": True,
    }
    response = httpx.post(base + "/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    after = server_counters(base)
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    if not grew.get("draft_tokens"):
        raise RuntimeError(f"the server's spec-decode counters did not grow: {grew}")
    rate = grew["accepted"] / grew["draft_tokens"]
    return rate, 1 + grew["accepted"] / grew["drafts"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="draft lengths")
    args = parser.parse_args()
    prompts = heldout_sequences(PROMPTS, PROMPT_LEN, offset=OFFSET)
    with tempfile.TemporaryDirectory() as folder:
        for k in args.k:
            proc, base = start(k, Path(folder) / f"serve_k{k}.txt")
            try:
                for temperature in (0.0, 1.0):
                    rate, length = acceptance(base, prompts, temperature)
                    print(
                        f"serve k={k} T={temperature}: acceptance {rate:.3f}, "
                        f"mean accepted length {length:.3f}",
                        flush=True,
                    )
            finally:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()
