"""`spmoe serve --help`: flags in the sections users look in, each option's vLLM aliases on one
line, and vLLM's refused or no-op flags left to docs/vllm-compatibility.md."""

import argparse
import re
from pathlib import Path

import pytest

from spmoe.entrypoints.cli import main
from spmoe.entrypoints.options import option


def serve_help(capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def sections(text: str) -> dict[str, str]:
    """The help's sections by title: the lines under `title:` up to the next title."""
    parts = re.split(r"^([a-z][a-zA-Z ]*):$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_sections_come_in_the_users_order(capsys):
    titles = list(sections(serve_help(capsys)))
    assert titles == [
        "options",
        "model",
        "parallelism",
        "memory and cache",
        "speculation and CUDA graphs",
        "chat and tools",
        "server",
        "logging",
    ]


@pytest.mark.parametrize(
    "title, flag",
    [
        ("model", "--load-format"),
        ("model", "--tokenizer"),
        ("model", "--generation-config"),
        ("parallelism", "--tp, --tensor-parallel-size, -tp TP"),
        ("parallelism", "--sp "),
        ("parallelism", "--moe-backend"),
        ("memory and cache", "--kv-cache-dtype"),
        ("memory and cache", "--gpu-memory-utilization"),
        ("memory and cache", "--max-model-len"),
        ("speculation and CUDA graphs", "--speculative-config"),
        ("speculation and CUDA graphs", "--enforce-eager"),
        ("chat and tools", "--tool-call-parser"),
        ("chat and tools", "--chat-template "),
        ("server", "--port"),
        ("server", "--api-key"),
        ("server", "--served-model-name"),
        ("logging", "--uvicorn-log-level"),
    ],
)
def test_each_flag_sits_in_its_section(capsys, title, flag):
    help_sections = sections(serve_help(capsys))
    assert flag in help_sections[title], f"{flag!r} not under {title!r}"
    others = [t for t, body in help_sections.items() if t != title and f"  {flag}" in body]
    assert others == [], f"{flag!r} also under {others}"


def test_aliases_are_named_once_with_one_value(capsys):
    text = serve_help(capsys)
    assert "--dp, --data-parallel-size, -dp DP" in text
    assert "--tensor-parallel-size TP" not in text  # argparse's own form repeats the value
    assert text.count("--tensor-parallel-size") == 1


def test_refused_and_noop_vllm_flags_stay_out_of_help(capsys):
    text = serve_help(capsys)
    for flag in (
        "--enable-lora",
        "--pipeline-parallel-size",
        "--swap-space",
        "--disable-log-stats",
    ):
        assert flag not in text


def test_an_option_outside_the_help_sections_is_named():
    with pytest.raises(ValueError, match=r"--brand-new: section must be one of .*got 'misc'"):
        option("--brand-new", section="misc", type=int, help="new")
    parser = argparse.ArgumentParser()
    option("--brand-new", section="parallelism", type=int, help="new").add_to(
        parser, "brand_new", 0
    )
    titles = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert "brand_new" in titles["parallelism"]


def test_docs_serving_holds_the_current_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    text = serve_help(capsys)
    current = text[text.index("\nmodel:\n") + 1 :]
    page = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    recorded = page.split("<!-- spmoe serve --help -->\n```\n")[1].split("```\n<!-- end")[0]
    assert recorded == current, (
        "docs/serving.md's help text is out of date: paste in the output of "
        "`COLUMNS=100 spmoe serve --help | sed -n '/^model:/,$p'`"
    )
