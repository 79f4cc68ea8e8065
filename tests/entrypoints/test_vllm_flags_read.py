"""Reading `vllm serve`'s options from a wheel without running it: small wheels laid out as vLLM's
(an early release's hand-written parser; a later one's flags built from config dataclasses) give the
names and arities argparse would register; the union of several releases' rows is what the pinned
release lacks, each with the releases it was read in."""

import textwrap
import zipfile

from spmoe.entrypoints.vllm_flags_read import before_pinned, read_wheel, version_key


def wheel(tmp_path, version: str, files: dict[str, str]):
    path = tmp_path / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, textwrap.dedent(text))
    return path


EARLY = {
    "vllm/scripts.py": """
        def main():
            serve_parser = subparsers.add_parser("serve")
            serve_parser.add_argument("model_tag", type=str)
            serve_parser.add_argument("--config", type=str, default="")
            chat_parser.add_argument("--url", type=str)  # another subcommand's
    """,
    "vllm/entrypoints/openai/cli_args.py": """
        import json
        from vllm.engine.arg_utils import AsyncEngineArgs

        def make_arg_parser(parser):
            parser.add_argument("--host", type=str)
            parser.add_argument("--allowed-origins", type=json.loads, default=["*"])
            parser.add_argument("--lora-modules", nargs="+", action=LoRAParserAction)
            parser.add_argument("--disable-frontend-multiprocessing", action="store_true")
            parser = AsyncEngineArgs.add_cli_args(parser)
            return parser
    """,
    "vllm/engine/arg_utils.py": """
        class EngineArgs:
            @staticmethod
            def add_cli_args(parser):
                parser.add_argument("--tensor-parallel-size", "-tp", type=int)
                parser.add_argument("--enable-chunked-prefill", action=StoreBoolean, nargs="?")
                parser.add_argument("--ignore-patterns", action="append", default=[])
                return parser

        class AsyncEngineArgs(EngineArgs):
            @staticmethod
            def add_cli_args(parser):
                parser = EngineArgs.add_cli_args(parser)
                parser.add_argument("--disable-log-requests", action="store_true")
                return parser
    """,
}


def test_an_early_release_hand_written_parser(tmp_path):
    assert read_wheel(wheel(tmp_path, "0.6.0", EARLY)) == [
        (("--help", "-h"), "switch"),
        (("--config",), "value"),
        (("--host",), "value"),
        (("--allowed-origins",), "json"),
        (("--lora-modules",), "values"),
        (("--disable-frontend-multiprocessing",), "switch"),
        (("--tensor-parallel-size", "-tp"), "value"),
        (("--enable-chunked-prefill",), "optional"),
        (("--ignore-patterns",), "value"),
        (("--disable-log-requests",), "switch"),
    ]


LATER = {
    "vllm/utils/argparse_utils.py": """
        class EnableDisableAction(BooleanOptionalAction):
            pass
    """,
    "vllm/config/__init__.py": """
        from vllm.config.model import ModelConfig
        from vllm.config.speculative import SpeculativeConfig
    """,
    "vllm/config/speculative.py": """
        @config
        class SpeculativeConfig:
            method: str | None = None
    """,
    "vllm/config/model.py": """
        from typing import Annotated, Literal, Optional
        from vllm.config.speculative import SpeculativeConfig
        from vllm.quant import QuantizationMethods

        HfOverrides = dict[str, Any] | Callable

        @config
        class ModelConfig:
            enforce_eager: bool = False
            enable_prefix_caching: Optional[bool] = None
            hf_token: bool | str | None = None
            served_model_name: list[str] | None = None
            quantization: QuantizationMethods | None = None
            hf_overrides: HfOverrides = field(default_factory=dict)
            speculative_config: "SpeculativeConfig | None" = None
            max_model_len: Annotated[int, "positions"] | None = None
            stop: ClassVar[int] = 3
    """,
    "vllm/quant.py": """
        QuantizationMethods = Literal["fp8", "awq"]
    """,
    "vllm/entrypoints/openai/cli_args.py": """
        from vllm.engine.arg_utils import AsyncEngineArgs

        @config
        class BaseFrontendArgs:
            lora_modules: list[str] | None = None
            enable_auto_tool_choice: bool = False

            @classmethod
            def _customize_cli_kwargs(cls, frontend_kwargs):
                frontend_kwargs["lora_modules"]["type"] = optional_type(str)
                return frontend_kwargs

            @classmethod
            def add_cli_args(cls, parser):
                frontend_kwargs = get_kwargs(cls)
                frontend_kwargs = cls._customize_cli_kwargs(frontend_kwargs)
                for key, value in frontend_kwargs.items():
                    extra_flags = value.pop("flags", [])
                    parser.add_argument(*extra_flags, f"--{key.replace('_', '-')}", **value)
                return parser

        @config
        class FrontendArgs(BaseFrontendArgs):
            allowed_origins: list[str] = field(default_factory=list)
            api_key: list[str] | None = None

            @classmethod
            def _customize_cli_kwargs(cls, frontend_kwargs):
                frontend_kwargs = super()._customize_cli_kwargs(frontend_kwargs)
                frontend_kwargs["allowed_origins"]["type"] = json.loads
                del frontend_kwargs["allowed_origins"]["nargs"]
                frontend_kwargs["api_key"]["flags"] = ["-k"]
                return frontend_kwargs

        def make_arg_parser(parser):
            parser.add_argument("model_tag", type=str, nargs="?")
            parser.add_argument("--headless", action="store_true")
            parser = FrontendArgs.add_cli_args(parser)
            parser = AsyncEngineArgs.add_cli_args(parser)
            return parser
    """,
    "vllm/engine/arg_utils.py": """
        from vllm.config import ModelConfig, SpeculativeConfig

        def _compute_kwargs(cls):
            generator = (th for th in type_hints if is_dataclass(th))
            if type_hints == {bool, str, type(None)}:
                pass

        class EngineArgs:
            @staticmethod
            def add_cli_args(parser):
                model_kwargs = get_kwargs(ModelConfig)
                model_kwargs["served_model_name"]["nargs"] = "?"
                group = parser.add_argument_group("ModelConfig")
                group.add_argument("--enforce-eager", **model_kwargs["enforce_eager"])
                group.add_argument(
                    "--enable-prefix-caching", "-epc", **model_kwargs["enable_prefix_caching"]
                )
                group.add_argument("--hf-token", **model_kwargs["hf_token"])
                group.add_argument("--served-model-name", **model_kwargs["served_model_name"])
                group.add_argument("--quantization", "-q", **model_kwargs["quantization"])
                group.add_argument("--hf-overrides", **model_kwargs["hf_overrides"])
                group.add_argument("--speculative-config", **model_kwargs["speculative_config"])
                group.add_argument("--max-model-len", **{**model_kwargs["max_model_len"], "a": 1})
                group.add_argument("--legacy", action=argparse.BooleanOptionalAction)
                return parser

        class AsyncEngineArgs(EngineArgs):
            @staticmethod
            def add_cli_args(parser):
                parser = super().add_cli_args(parser)
                parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction)
                return parser
    """,
}


def test_a_later_release_flags_from_config_dataclasses(tmp_path):
    """Types as vLLM's get_kwargs reads them: a bool is a switch with its `--no-` form (hidden where
    `--enable-x` pairs with `--disable-x`), a list several values, a Literal (through an imported
    alias) or an int one value, a dict alias or a config dataclass (a forward reference too) JSON,
    `bool | str | None` an optional value; the parser's own overrides win."""
    assert read_wheel(wheel(tmp_path, "0.20.0", LATER)) == [
        (("--help", "-h"), "switch"),
        (("--headless",), "switch"),
        (("--lora-modules",), "values"),
        (
            (
                "--enable-auto-tool-choice",
                "--disable-auto-tool-choice",
                "--no-enable-auto-tool-choice",
            ),
            "switch",
        ),
        (("--allowed-origins",), "json"),
        (("--api-key", "-k"), "values"),
        (("--enforce-eager", "--no-enforce-eager"), "switch"),
        (
            (
                "--enable-prefix-caching",
                "--disable-prefix-caching",
                "-epc",
                "--no-enable-prefix-caching",
            ),
            "switch",
        ),
        (("--hf-token",), "optional"),
        (("--served-model-name",), "optional"),
        (("--quantization", "-q"), "value"),
        (("--hf-overrides",), "json"),
        (("--speculative-config",), "json"),
        (("--max-model-len",), "value"),
        (("--legacy", "--no-legacy"), "switch"),
        (("--enable-log-requests", "--disable-log-requests", "--no-enable-log-requests"), "switch"),
    ]


def test_the_union_is_what_the_pinned_release_lacks():
    """New names get the widest arity they had and the releases they were read in; a pinned name
    whose older form the pinned arity cannot read (an optional true / false, now a switch) gets a
    row of that form; a name the pinned release reads as it was (one value, now several) none."""
    releases = {
        "0.9.2": [
            (("--swap-space",), "value"),
            (("--chunked", "--no-chunked"), "switch"),
            (("--api-key",), "values"),
            (("--steps", "--no-steps"), "switch"),
        ],
        "0.6.0": [
            (("--swap-space",), "value"),
            (("--chunked",), "optional"),
            (("--api-key",), "value"),
            (("--steps",), "optional"),
        ],
        "0.10.2": [(("--api-key",), "values"), (("--chunked", "--no-chunked"), "switch")],
    }
    pinned = [(("--chunked", "--no-chunked"), "switch"), (("--api-key",), "values")]
    assert before_pinned(releases, pinned) == [
        (("--swap-space",), "value", "0.6.0", "0.9.2"),
        (("--chunked",), "optional", "0.6.0", "0.6.0"),
        (("--steps",), "optional", "0.6.0", "0.9.2"),
        (("--no-steps",), "switch", "0.9.2", "0.9.2"),
    ]
    assert sorted(releases, key=version_key) == ["0.6.0", "0.9.2", "0.10.2"]
