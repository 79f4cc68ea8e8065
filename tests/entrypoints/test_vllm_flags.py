"""vLLM's serve flags on `spmoe serve`'s command line: every name vLLM 0.34.0 accepts, and every
name of the releases from 0.6 to 0.33 that 0.34.0 no longer has, is known (taken, ignored with a
note, or refused in one line with exit status 2), vLLM's spellings are read, and the docs page's
tables are the table's own rendering."""

import re

import pytest

from spmoe.entrypoints import vllm_flags_0_34, vllm_flags_before_0_34
from spmoe.entrypoints.cli import OneLineParser, prepare_argv
from spmoe.entrypoints.serve.server import add_serve_args
from spmoe.entrypoints.vllm_flags import (
    JSON_SHORT,
    PAGE,
    SPEC_SHORTHANDS,
    VLLM_FLAGS,
    markdown_table,
    with_flag_tables,
)

VERDICT = {name: flag for flag in VLLM_FLAGS for name in flag.names}
SAMPLE = {"switch": [], "optional": [], "value": ["1"], "values": ["1", "2"], "json": ["{}"]}


def read_as(name: str) -> str:
    """The name spmoe's parser sees for vLLM's `name` (a JSON option's short name: its long one)."""
    return "--speculative-config" if name in SPEC_SHORTHANDS else JSON_SHORT.get(name, name)


def parse(argv: list[str]):
    """`spmoe serve ARGV` parsed as `spmoe` parses it."""
    parser = OneLineParser(prog="spmoe serve")
    add_serve_args(parser)
    return parser.parse_args(prepare_argv(["serve", *argv])[1:])  # as main sees it


def outcome(argv: list[str], capsys) -> tuple[int, str, object]:
    """(exit status, stderr, namespace or None) of parsing `argv`."""
    try:
        args = parse(argv)
    except SystemExit as e:
        return e.code, capsys.readouterr().err, None
    return 0, capsys.readouterr().err, args


def test_the_pinned_list_is_complete():
    """vLLM 0.34.0's parser registers 328 options under 496 names (472 long, 24 short, -h
    included)."""
    rows = vllm_flags_0_34.options()
    names = [name for row_names, _ in rows for name in row_names]
    assert (len(rows), len(names), len(set(names))) == (328, 496, 496)
    assert sum(name.startswith("--") for name in names) == 472
    assert {"--no-disable-fastapi-docs", "--no-enable-prefix-caching", "-asc", "-cc"} <= set(names)
    assert sum(kind == "json" for _, kind in rows) == 39


def test_the_table_covers_every_name_once():
    names = [name for flag in VLLM_FLAGS for name in flag.names]
    assert len(names) == len(set(names))
    pinned = {name for row_names, _ in vllm_flags_0_34.options() for name in row_names}
    assert sorted(pinned - set(names)) == []
    for flag in VLLM_FLAGS:
        assert flag.verdict in ("taken", "noted", "ignored", "refused")
        assert bool(flag.instead) == (flag.verdict == "refused"), flag.names
        assert flag.note, flag.names


def check_name(name: str, sample: list[str], capsys) -> None:
    """`spmoe serve MODEL NAME SAMPLE...` does what NAME's verdict says, never in argparse's words."""
    flag = VERDICT[name]
    argv = ["MODEL", "--tp", "1", name, *sample]  # MODEL first: no value is taken for it
    status, err, args = outcome(argv, capsys)
    argparse_words = ("unrecognized arguments", "ambiguous", "invalid choice")
    assert not any(words in err for words in argparse_words), (argv, err)
    arity_errors = ("expected one argument", "expected at least one", "ignored explicit argument")
    assert not any(e in err for e in arity_errors), (argv, err)  # spmoe takes vLLM's arity
    if flag.verdict == "refused" and (
        flag.allowed is None or not flag.allowed(" ".join(argv[4:]) or None)
    ):
        assert (
            status == 2
            and err.startswith(f"spmoe serve: error: {read_as(name)}")
            and err.count("\n") == 1
        )
        assert "spmoe does not support" in err, (argv, err)
    elif flag.verdict == "ignored":
        assert status == 0, (argv, err)
        assert args.vllm_notes == [f"{read_as(name)}: ignored: {flag.note}"]
    elif status != 0:  # taken: a sample value spmoe's option rejects, in one line naming it
        assert status == 2 and read_as(name) in err and err.count("\n") == 1, (argv, err)


@pytest.mark.parametrize(
    "names, arity",
    vllm_flags_0_34.options(),
    ids=[names[0] for names, _ in vllm_flags_0_34.options()],
)
def test_every_vllm_name_is_known_and_does_what_its_verdict_says(names, arity, capsys, tmp_path):
    config = tmp_path / "options.yaml"
    config.write_text("max-model-len: 1k\n")
    for name in names:
        if name not in ("--help", "-h"):
            check_name(name, [str(config)] if name == "--config" else SAMPLE[arity], capsys)


OLDER = vllm_flags_before_0_34.options()


@pytest.mark.parametrize(
    "names, arity, first, last", OLDER, ids=[f"{names[0]}@{first}" for names, _, first, _ in OLDER]
)
def test_every_name_of_older_releases_is_known(names, arity, first, last, capsys):
    """What vLLM 0.6 to 0.33 took: the value forms they took (an optional true / false after a
    switch included) do what the name's verdict says."""
    for name in names:
        for sample in [[], ["true"]] if arity == "optional" else [SAMPLE[arity]]:
            check_name(name, sample, capsys)
        if arity == "optional":  # false: the switch's off form, whose verdict may differ
            status, err, _ = outcome(["MODEL", name, "False"], capsys)
            assert "unrecognized" not in err and "invalid choice" not in err, err
            assert status == 0 or ("spmoe does not support" in err and err.count("\n") == 1)


def test_the_older_list_spans_0_6_to_0_33():
    """Releases 0.6.0 to 0.33.0; each row's releases among them, in order; no name twice, none of
    0.34.0's unless its form changed (an optional true / false where 0.34 has a switch)."""
    releases = vllm_flags_before_0_34.RELEASES
    assert (releases[0], releases[-1]) == ("0.6.0", "0.33.0") and len(releases) >= 5
    pinned = {name for names, _ in vllm_flags_0_34.options() for name in names}
    names = [name for row in OLDER for name in row[0]]
    assert len(names) == len(set(names))
    for row_names, arity, first, last in OLDER:
        assert releases.index(first) <= releases.index(last), row_names
        assert arity in ("switch", "value", "values", "optional", "json"), row_names
        assert not set(row_names) & pinned or arity == "optional", row_names
    # what the vLLM releases are known to have taken, and when
    rows = {row[0][0]: row[1:] for row in OLDER}
    assert rows["--guided-decoding-backend"] == ("value", "0.6.0", "0.10.2")
    assert rows["--enable-chunked-prefill"] == ("optional", "0.6.0", "0.7.3")
    assert rows["--swap-space"][0] == "value" and rows["--use-v2-block-manager"][0] == "switch"


def test_the_table_covers_every_older_name():
    names = {name for flag in VLLM_FLAGS for name in flag.names}
    pinned = {name for names, _ in vllm_flags_0_34.options() for name in names}
    older = {name for row in OLDER for name in row[0]}
    assert sorted(older - pinned - names) == []
    assert sorted(names - pinned - older) == ["model"]  # the positional MODEL; nothing else


@pytest.mark.parametrize(
    "argv, noted",
    [
        (["--enable-chunked-prefill", "True"], "--enable-chunked-prefill"),
        (["--enable-chunked-prefill=true"], "--enable-chunked-prefill"),
        (["--enable_chunked_prefill", "TRUE"], "--enable-chunked-prefill"),
        (["--multi-step-stream-outputs", "false"], "--no-multi-step-stream-outputs"),
        (
            ["--disable-logprobs-during-spec-decoding", "False"],
            "--disable-logprobs-during-spec-decoding",
        ),
    ],
)
def test_an_optional_true_or_false_is_read(argv, noted):
    """vLLM before 0.8 took `--enable-chunked-prefill false`: the value is the switch's, not a
    second MODEL; false is the switch's off form where vLLM has one."""
    args = parse([*argv, "MODEL"])
    assert args.model_tag == "MODEL"
    assert [note.partition(":")[0] for note in args.vllm_notes] == [noted]


def test_an_optional_false_turning_chunked_prefill_off_is_refused(capsys):
    status, err, _ = outcome(["MODEL", "--enable-chunked-prefill", "false"], capsys)
    assert status == 2 and "spmoe does not support turning chunked prefill off" in err


def test_every_json_option_takes_the_dotted_form(capsys):
    json_options = [names[0] for names, arity in vllm_flags_0_34.options() if arity == "json"]
    assert len(json_options) == 39
    special = {
        "--speculative-config": ("method", "mtp"),
        "--hf-overrides": ("num_hidden_layers", "2"),
    }
    for name in json_options:
        key, value = special.get(name, ("some_key.inner", "3"))
        status, err, args = outcome([f"{name}.{key}", value], capsys)
        assert "unrecognized arguments" not in err, (name, err)
        if VERDICT[name].verdict == "ignored":
            assert status == 0 and args.vllm_notes == [f"{name}: ignored: {VERDICT[name].note}"]
        elif VERDICT[name].verdict == "refused":
            assert status == 2 and err.startswith(
                f'spmoe serve: error: {name} {{"{key.split(".")[0]}"'
            )
    args = parse(["--speculative-config.method", "mtp", "--hf-overrides.num_hidden_layers", "2"])
    assert args.speculative_config == {"method": "mtp"} and args.hf_overrides == {
        "num_hidden_layers": 2
    }


@pytest.mark.parametrize(
    "argv", [["-O3"], ["-O=3"], ["-O", "3"], ["-Odecode"], ["--optimization_level", "3"]]
)
def test_o_is_the_optimization_level(argv):
    args = parse(argv)
    assert args.vllm_notes == [
        f"--optimization-level: ignored: {VERDICT['--optimization-level'].note}"
    ]


def test_vllm_spellings_reach_spmoes_options():
    args = parse(["--max_model_len", "1k", "--spec-method", "mtp", "--spec-tokens", "2"])
    assert args.max_model_len == 1000
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    args = parse(
        ["--kv-cache-memory-bytes", "2G", "--disable-prefix-caching", "--no-enforce-eager", "-ep"]
    )
    assert args.kv_cache_memory == 2.0 and args.enable_prefix_caching is False
    assert args.enforce_eager is False and args.enable_expert_parallel is True
    args = parse(
        ["--enable-auto-tool-choice", "--tool-call-parser", "glm47", "--disable-auto-tool-choice"]
    )
    assert args.enable_auto_tool_choice is False
    assert parse(["--device-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5
    args = parse(["-sc.method", "mtp", "-sc.num_speculative_tokens", "3"])
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    note = VERDICT["--compilation-config"].note
    assert parse(["-cc.mode", "3"]).vllm_notes == [f"--compilation-config: ignored: {note}"]


def test_a_config_file_gives_options_the_command_line_overrides(tmp_path):
    config = tmp_path / "serve.yml"
    config.write_text(
        "model: org/glm\ntensor-parallel-size: 2\nmax_model_len: 4k\nenforce-eager: true\n"
        "enable-prefix-caching: false\nserved-model-name: [a, b]\n"
        "speculative-config:\n  method: mtp\n  num_speculative_tokens: 2\n"
        "disable-custom-all-reduce: true\n"
    )
    args = parse(["--config", str(config), "--tp", "4"])
    assert (args.model, args.tp, args.max_model_len, args.enforce_eager) == (
        "org/glm",
        4,
        4000,
        True,
    )
    assert args.enable_prefix_caching is False and args.served_model_name == ["a", "b"]
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    assert args.vllm_notes == [
        f"--disable-custom-all-reduce: ignored: {VERDICT['--disable-custom-all-reduce'].note}"
    ]
    assert parse(["MODEL", f"--config={config}"]).model_tag == "MODEL"


@pytest.mark.parametrize(
    "text, name, expected",
    [
        ("port: 1\n", "options.json", "--config: expected a .yaml or .yml file, got"),
        ("- a\n- b\n", "list.yaml", "expected a mapping of options, got list"),
        ("a: [\n", "bad.yaml", "--config"),
    ],
)
def test_a_bad_config_file_is_one_line(text, name, expected, tmp_path):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(expected)):
        parse(["--config", str(path)])
    with pytest.raises(ValueError, match="no such file|No such file"):
        parse(["--config", str(tmp_path / "absent.yaml")])


def test_an_ignored_flag_is_noted_once(capsys):
    args = parse(
        [
            "--disable-custom-all-reduce",
            "--disable-custom-all-reduce",
            "--no-disable-custom-all-reduce",
        ]
    )
    note = VERDICT["--disable-custom-all-reduce"].note
    assert args.vllm_notes == [
        f"--disable-custom-all-reduce: ignored: {note}",
        f"--no-disable-custom-all-reduce: ignored: {note}",
    ]
    assert parse([]).vllm_notes == []


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["-pp", "2"],
            "-pp 2: spmoe does not support pipeline parallelism; for several machines run spmoe",
        ),
        (
            ["--distributed-executor-backend", "ray"],
            "--distributed-executor-backend ray: spmoe does not support the ray",
        ),
        (
            ["--data-parallel-address", "10.0.0.1"],
            "--data-parallel-address 10.0.0.1: spmoe does not support vLLM's",
        ),
        (
            ["--headless"],
            "--headless: spmoe does not support vLLM's multi-node data parallelism; for several",
        ),
        (
            ["--disable-chunked-prefill"],
            "--disable-chunked-prefill: spmoe does not support turning chunked",
        ),
        (
            ["--tokenizer-mode", "deepseek_v32"],
            "--tokenizer-mode deepseek_v32: spmoe does not support other tokenizer",
        ),
        (
            ["--max-logprobs", "50"],
            "--max-logprobs 50: spmoe does not support another limit of top logprobs",
        ),
        (["-dcp", "2"], "-dcp 2: spmoe does not support context parallelism"),
        (
            ["--ssl-keyfile", "k.pem"],
            "--ssl-keyfile k.pem: spmoe does not support TLS; spmoe serves plain HTTP",
        ),
    ],
)
def test_a_refused_flag_is_one_line_and_exit_2(argv, expected, capsys):
    status, err, _ = outcome(["--tp", "2", *argv], capsys)
    assert status == 2
    assert err.startswith(f"spmoe serve: error: {expected}") and err.count("\n") == 1, err


def test_values_that_ask_for_what_spmoe_does_are_accepted():
    args = parse(
        [
            "-pp",
            "1",
            "--max-logprobs",
            "20",
            "--distributed-executor-backend",
            "mp",
            "-dcp",
            "1",
            "--tp",
            "4",
        ]
    )
    assert args.tp == 4 and args.vllm_notes == []
    assert not {"pipeline_parallel_size", "max_logprobs"} & set(
        vars(args)
    )  # nothing else is stored


def test_multi_node_refusals_give_the_torchrun_line(capsys):
    status, err, _ = outcome(["--nnodes", "2"], capsys)
    assert status == 2 and "torchrun --nnodes 2 --node-rank R --nproc-per-node 8" in err


def test_an_unknown_flag_is_still_an_error(capsys):
    status, err, _ = outcome(["--not-a-vllm-flag"], capsys)
    assert status == 2 and "unrecognized arguments: --not-a-vllm-flag" in err


def test_the_docs_page_is_current():
    page = PAGE.read_text()
    assert with_flag_tables(page) == page, "run: python -m spmoe.entrypoints.vllm_flags"
    for flag in VLLM_FLAGS:
        names = ", ".join(f"`{name}`" for name in flag.names)
        assert f"| {names} |" in page or f"| {names} (vLLM " in page, flag.names
    assert (
        "| `--guided-decoding-backend` (vLLM 0.6.0 to 0.10.2) | accepted without effect |" in page
    )


def test_the_readme_links_the_page_instead_of_copying_it():
    readme = (PAGE.parents[1] / "README.md").read_text()
    assert "(docs/vllm-compatibility.md)" in readme
    assert markdown_table().splitlines()[0] not in readme
