"""`spmoe generate`: the output contract, one-line errors for bad input; `spmoe demo` end to end."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spmoe.entrypoints.cli import main


def generate_cli(tmp_path, model, prompts, *extra):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(prompts))
    return main(
        [
            "generate",
            "--model",
            str(model),
            "--tp",
            "2",
            "--sp",
            "on",
            "--input-ids",
            str(ids),
            "--output",
            str(tmp_path / "out.json"),
            *extra,
        ]
    )


def test_generate_writes_outputs_and_stats(engine_checkpoint, tmp_path, capsys):
    prompts = [[3, 14, 15], [79], [38, 1]]
    assert (
        generate_cli(
            tmp_path,
            engine_checkpoint,
            prompts,
            "--max-new-tokens",
            "6",
            "--speculative",
            "mtp",
            "--num-speculative-tokens",
            "2",
        )
        == 0
    )
    result = json.loads((tmp_path / "out.json").read_text())
    assert [len(out) for out in result["outputs"]] == [6, 6, 6]
    stats = result["stats"]
    assert stats["generated_tokens"] == 18 and stats["tokens_per_s"] > 0
    assert stats["prefill_s"] > 0 and stats["decode_s"] > 0
    assert stats["parallel"] == {
        "tp": 2,
        "dp": 1,
        "use_sequence_parallel_moe": True,
        "sp_scope": "moe",
        "ep_backend": "allgather_reducescatter",
    }
    assert stats["phases"]["decode"]["collectives"]["reduce_scatter"]["count"] > 0
    assert stats["phases"]["draft"]["collectives"]["all_reduce"]["count"] == 0  # the SP MTP step
    assert 0 <= stats["speculative"]["acceptance_rate"] <= 1
    # kv_lora 16 + rope 8 per layer, indexer key 16 on the 3 indexer layers (2 main + MTP), float32
    assert stats["kv_cache"]["bytes_per_token"] == (4 * 24 + 3 * 16) * 4
    assert "draft acceptance" in capsys.readouterr().err


def test_vllm_lookup_launch_lines_generate_the_plain_tokens(engine_checkpoint, tmp_path):
    """vLLM's ngram and suffix lines (JSON and dotted keys) and spmoe's hybrid, on 2 TP ranks with SP:
    the tokens without speculation, each step's draft source counted."""
    prompts = [[3, 14, 15, 3, 14, 15, 3], [79, 32, 79, 32]]
    lines = {
        "plain": [],
        "ngram": [
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
        ],
        "suffix": [
            "--speculative-config.method", "suffix",
            "--speculative-config.num_speculative_tokens", "4",
        ],
        "mtp+ngram": [
            "--speculative-config",
            '{"method": "mtp+ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}',
        ],
    }  # fmt: skip
    got = {}
    for name, line in lines.items():
        assert (
            generate_cli(tmp_path, engine_checkpoint, prompts, "--max-new-tokens", "12", *line) == 0
        )
        got[name] = json.loads((tmp_path / "out.json").read_text())
    for name in ("ngram", "suffix", "mtp+ngram"):
        assert got[name]["outputs"] == got["plain"]["outputs"], name
        sources = got[name]["stats"]["speculative"]["by_source"]
        assert sum(counts["chosen"] for counts in sources.values()) > 0, (name, sources)
    assert got["ngram"]["stats"]["speculative"]["by_source"]["ngram"]["chosen"] > 0


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("token id out of range", "token id 96, expected an int in [0, 96)"),
        (
            "prompt longer than the cache",
            "prompt 0 has 3 tokens; with max_new_tokens=4 and 0 speculative tokens it "
            "needs 7 KV cache positions, the cache holds 5 per sequence",
        ),
        ("no MTP layer", "--speculative mtp needs an MTP layer"),
        ("zero new tokens", "max_new_tokens must be >= 1, got 0"),
        (
            "expert kernel that does not fit",
            "moe_backend 'triton' does not fit this deployment: triton: needs a CUDA device, got cpu",
        ),
    ],
)
def test_bad_input_is_a_one_line_error(case, fragment, engine_checkpoint, tmp_path, capsys):
    model, prompts, extra = engine_checkpoint, [[1, 2, 3]], ["--max-new-tokens", "4"]
    if case == "token id out of range":
        prompts = [[1, 96]]
    elif case == "prompt longer than the cache":
        extra += ["--max-model-len", "5"]
    elif case == "no MTP layer":
        model = tmp_path / "model"
        shutil.copytree(engine_checkpoint, model)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
        extra += ["--speculative", "mtp"]
    elif case == "zero new tokens":
        extra = ["--max-new-tokens", "0"]
    elif case == "expert kernel that does not fit":
        extra += ["--moe-backend", "triton"]
    assert generate_cli(tmp_path, model, prompts, *extra) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("spmoe generate: error: ") and fragment in err[-1], err


@pytest.mark.parametrize(
    "command, extra",
    [("forward", ["--save-logits"]), ("generate", ["--max-new-tokens", "2", "--output"])],
)
def test_sp_defaults_to_auto(command, extra, engine_checkpoint, tmp_path, capsys, monkeypatch):
    """Without --sp the command takes auto: off at DP 1, on at DP 2. The job itself is replaced by one that
    records the parallel config it was given and returns None (as on a torchrun rank other than 0), so no rank
    starts; every check before it runs for real."""
    given = []
    if command == "forward":
        job = lambda _, parallel, *a: given.append(parallel)  # noqa: E731
    else:  # generate: the engine options carry the layout
        job = lambda _, prompts, opts: given.append(opts.engine.parallel_config())  # noqa: E731
    monkeypatch.setattr(f"spmoe.entrypoints.{command}.run_{command}", job)
    ids = tmp_path / "ids.json"
    ids.write_text("[[1, 2]]")
    for dp, decision in ((1, "off"), (2, "on")):
        assert (
            main(
                [
                    command,
                    "--model",
                    engine_checkpoint,
                    "--tp",
                    "2",
                    "--dp",
                    str(dp),
                    "--input-ids",
                    str(ids),
                    *extra,
                    str(tmp_path / "out"),
                ]
            )
            == 0
        )
        err = capsys.readouterr().err
        assert f"sequence-parallel MoE {decision} (--sp auto, scope moe)" in err, err
        assert given[-1].sp == "auto" and given[-1].use_sequence_parallel_moe == (dp == 2)
    assert len(given) == 2


def test_unknown_option_exits_non_zero(engine_checkpoint, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        generate_cli(
            tmp_path, engine_checkpoint, [[1]], "--max-new-tokens", "2", "--beam-width", "4"
        )
    assert exit_info.value.code == 2


def collective_cells(text: str) -> dict[str, list[str]]:
    """The demo table's rows -> their all_reduce, all_gather and reduce_scatter cells (count/KiB)."""
    from spmoe.entrypoints.demo import MODES

    labels = {label for label, *_ in MODES}
    return {
        line[:18].strip(): line[18:].split()[1:4]
        for line in text.splitlines()
        if line[:18].strip() in labels
    }


def test_demo_runs_on_the_trained_checkpoint():
    from spmoe.entrypoints.demo import CHECKPOINT, TEXT_PROMPTS

    done = subprocess.run(
        [sys.executable, "-m", "spmoe", "demo"], capture_output=True, text=True, timeout=300
    )
    # one run: the checkpoint ships with spmoe, nothing is written
    assert done.returncode == 0, done.stderr
    assert f"checkpoint: {CHECKPOINT}" in done.stdout
    assert "all 5 modes produced identical tokens" in done.stdout
    # the expert choice: once per kind of MoE layer
    assert [
        line.split(": ")[1]
        for line in done.stderr.splitlines()
        if line.startswith("spmoe: experts")
    ] == [
        "experts of non-SP MoE layers",
        "experts of SP MoE layers",
    ], done.stderr
    # a model of Python source continues Python source: printable ASCII, no stray bytes
    continuations = [
        json.loads(line.split(" -> ", 1)[1])
        for line in done.stdout.splitlines()
        if line.startswith('  "') and " -> " in line
    ]
    assert len(continuations) == len(TEXT_PROMPTS)
    text = "".join(continuations)
    assert sum(c.isprintable() or c in "\n" for c in text) >= 0.95 * len(text), text
    # the server: the chat template wraps the 9-byte message in 3 special tokens and opens the reply with the
    # 7 bytes of `<think>` (19 tokens); up to 24 tokens come back
    assert re.search(
        r"usage: 19 prompt \+ \d+ completion tokens, finish_reason (stop|length)", done.stdout
    )
    assert "SIGTERM: the server stopped" in done.stdout
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    table = collective_cells(readme)
    assert len(table) == 5 and table == collective_cells(done.stdout), (
        "README's demo table is out of date"
    )
