"""Long contexts on the CPU: `spmoe generate --tp 2` (gloo, float32, the paged cache and the torch kernels) on a
tiny GLM model that transformers writes, with
1. a 3000-token prompt: the generated tokens against what transformers' own forward predicts after the
   prompt and the tokens generated before each (its argmax at each of those positions);
2. a 32768-token prompt: it finishes, and each rank's peak resident memory (VmHWM, polled) stays below
   `--memory-limit-gib`.
Prints the wall time of each run. It takes minutes on 2 cores, so it is a script, not a test.

    python benchmarks/cpu_long_context.py [--max-num-batched-tokens 512] [--new-tokens 8]
"""

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

# the repository root, for the oracle tests' helper
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.models.deepseek_v32.conftest import make_nontrivial  # noqa: E402

CONFIG = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=72,
    moe_intermediate_size=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    n_routed_experts=12,
    num_experts_per_tok=3,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=8,
    qk_nope_head_dim=8,
    index_topk=64,
    index_head_dim=16,
    index_n_heads=8,
    max_position_embeddings=40000,
    num_hidden_layers=4,
    mlp_layer_types=["dense", "sparse", "dense", "sparse"],
    indexer_types=["full", "shared", "full", "shared"],
    n_group=1,
    topk_group=1,
)


def write_checkpoint(folder: Path):
    """A transformers GLM model with random weights made nontrivial as the oracle tests make them, saved."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**CONFIG)).eval()
    make_nontrivial(model)
    model.save_pretrained(folder)
    return model


class PeakMemory:
    """Polls the peak resident memory (VmHWM) of this process's children, the ranks, every 0.2 s."""

    def __init__(self):
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        me = Path("/proc/self").resolve().name
        while not self._stop.wait(0.2):
            for task in Path(f"/proc/{me}/task").iterdir():
                for pid in (task / "children").read_text().split():
                    try:
                        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                            if line.startswith("VmHWM:"):
                                self.peaks[int(pid)] = max(
                                    self.peaks.get(int(pid), 0), int(line.split()[1]) * 1024
                                )
                    except OSError:  # the child has exited
                        pass


def generate(
    folder: Path, prompt: list[int], args, work: Path
) -> tuple[list[int], dict, dict[int, int], float]:
    from spmoe.entrypoints.cli import main

    ids, out = work / "ids.json", work / "out.json"
    ids.write_text(json.dumps([prompt]))
    began = time.perf_counter()
    with PeakMemory() as memory:
        code = main(
            [
                "generate",
                "--model",
                str(folder),
                "--tp",
                "2",
                "--input-ids",
                str(ids),
                "--max-new-tokens",
                str(args.new_tokens),
                "--eos-id",
                "0",
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
                "--output",
                str(out),
            ]
        )
    seconds = time.perf_counter() - began
    if code != 0:
        raise SystemExit(f"spmoe generate failed with exit code {code}")
    result = json.loads(out.read_text())
    return result["outputs"][0], result["stats"], memory.peaks, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--memory-limit-gib", type=float, default=6.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="spmoe-long-"))
    folder = work / "model"
    hf = write_checkpoint(folder)
    gen = torch.Generator().manual_seed(11)

    prompt = torch.randint(1, CONFIG["vocab_size"], (3000,), generator=gen).tolist()
    tokens, stats, peaks, seconds = generate(folder, prompt, args, work)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    predicted = logits.argmax(-1).tolist()
    print(
        f"3000-token prompt: {seconds:.0f} s; spmoe {tokens}; transformers {predicted}; "
        f"{'EQUAL' if predicted == tokens else 'DIFFERENT'}; KV cache {stats['kv_cache']}",
        flush=True,
    )

    prompt = torch.randint(1, CONFIG["vocab_size"], (32768,), generator=gen).tolist()
    tokens, stats, peaks, seconds = generate(folder, prompt, args, work)
    worst = max(peaks.values()) / 2**30
    print(
        f"32768-token prompt: {seconds:.0f} s, {len(tokens)} tokens {tokens}, prefill {stats['prefill_s']:.0f} s, "
        f"decode {stats['decode_s']:.1f} s; peak RSS per rank {[round(p / 2**30, 2) for p in peaks.values()]} GiB "
        f"({'under' if worst < args.memory_limit_gib else 'OVER'} {args.memory_limit_gib} GiB); KV cache "
        f"{stats['kv_cache']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
