"""vLLM's value syntax on spmoe's command line: lengths with suffixes (`128k`), the speculative
config as JSON or in dotted form (`--speculative-config.method mtp`), `--hf-overrides` merged into
the model config, vLLM's names for the KV cache dtype and the model dtype, and several served model
names.

Every parser here takes the text the user wrote and returns spmoe's value, or raises ValueError with
one line naming the option, what it expected and what came.
"""

import argparse
import json
import re

from spmoe.config.model import merge_overrides
from spmoe.engine.cache.paged import BLOCK_SIZE
from spmoe.engine.speculation import NgramConfig, Speculation, SuffixConfig

DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}  # lower case: powers of ten
BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}  # upper case: powers of two
_LENGTH = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


def parse_length(text: str, option: str = "--max-model-len") -> int:
    """`2048`, `1k` (1000), `1K` (1024), `128k`, `25.6k` (25600), `1m`, `1M` -> an int (the option
    checks its range). A fraction is allowed with a lower-case (decimal) suffix only, and must come
    out whole."""
    match = _LENGTH.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"{option}: expected an integer, optionally with a suffix k/m/g (x1000) or K/M/G "
            f"(x1024), got {text!r}"
        )
    number, suffix = match.groups()
    if "." in number and suffix not in DECIMAL_SUFFIXES:
        raise ValueError(f"{option}: a fraction needs a decimal suffix (k, m, g), got {text!r}")
    if suffix in BINARY_SUFFIXES:
        value = int(number) * BINARY_SUFFIXES[suffix]
    else:
        scaled = float(number) * DECIMAL_SUFFIXES[suffix] if suffix else int(number)
        if scaled != int(scaled):
            raise ValueError(f"{option}: {text!r} is not a whole number of tokens")
        value = int(scaled)
    return value


def argparse_type(parse, option_name: str):
    """An argparse `type` from a value parser that raises ValueError("OPTION: why"): argparse's one
    line then names the option once."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{option_name}: ")) from None

    convert.__name__ = option_name
    return convert


def parse_json_object(text: str, option: str) -> dict:
    """A JSON object given on the command line."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{option}: expected a JSON object, got {text!r} ({e.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option}: expected a JSON object, got {type(value).__name__} {text!r}")
    return value


def fold_dotted(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """vLLM's dotted form of a JSON option, folded into the JSON form: `--speculative-config.method
    mtp --speculative-config.num_speculative_tokens 1` (or `--opt.key=value`, `--opt.a.b v` for
    nested keys) becomes one `--speculative-config '{"method": "mtp", "num_speculative_tokens":
    1}'`. A dotted value is read as JSON when it parses (`1`, `true`, `{...}`), else as a string.
    The JSON form and the dotted form may be mixed: they apply in the order given (objects merge key
    by key). Other arguments are untouched."""
    merged: dict[str, dict] = {}
    first_at: dict[str, int] = {}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, inline = arg.partition("=")
        base, dot, path = flag.partition(".")
        if base in options and arg.startswith("--"):
            if eq:
                value = inline
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise ValueError(f"{flag}: expected a value after it, got none")
            if base not in first_at:
                first_at[base] = len(out)
                out.append(base)
            target = merged.setdefault(base, {})
            if dot:
                keys = path.split(".")
                if not all(keys):
                    raise ValueError(
                        f"{flag}: expected {base}.KEY with a non-empty key, got {flag!r}"
                    )
                for key in keys[:-1]:
                    target = target.setdefault(key, {})
                    if not isinstance(target, dict):
                        raise ValueError(f"{flag}: {key} is set to a value, so it has no keys")
                target[keys[-1]] = _json_or_text(value)
            else:
                merged[base] = target = merge_overrides(target, parse_json_object(value, base))
        else:
            out.append(arg)
        i += 1
    # from the end: positions hold
    for base, at in sorted(first_at.items(), key=lambda item: -item[1]):
        out.insert(at + 1, json.dumps(merged[base]))
    return out


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


# vLLM's names for speculating with the checkpoint's own multi-token-prediction layers (DeepSeek-V3
# and GLM): all of them mean the same thing here.
MTP_METHODS = ("mtp", "deepseek_mtp", "glm4_moe_mtp")
# vLLM's lookups in the context, with the keys each takes
LOOKUP_KEYS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": (
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    ),
}
# spmoe's hybrids: MTP and a lookup in one draft (docs/architecture.md, "Speculation")
HYBRIDS = {"mtp+ngram": "ngram", "mtp+suffix": "suffix"}
SPECULATIVE_METHODS = (*MTP_METHODS, *LOOKUP_KEYS, *HYBRIDS)


class SpeculativeConfig:
    """vLLM's `--speculative-config` object, checked and turned into the engine's draft sources."""

    @staticmethod
    def parse(config: dict, target_model: str | None = None) -> Speculation:
        """`method`: MTP (one of MTP_METHODS), vLLM's `ngram` or `suffix`, or spmoe's hybrids
        `mtp+ngram` and `mtp+suffix`; each takes `num_speculative_tokens` and its lookup's keys,
        with vLLM's defaults (MTP: 1 draft; suffix: `suffix_decoding_max_tree_depth` drafts; n-gram
        and the hybrids: none, it must be given). `model`, if given, must be the served model
        itself."""
        option = "--speculative-config"
        known = ("method", "num_speculative_tokens", "model", *sum(LOOKUP_KEYS.values(), ()))
        unknown = [key for key in config if key not in known]
        if unknown:
            raise ValueError(
                f"{option}: spmoe does not support the key {unknown[0]!r}; it takes "
                f"{', '.join(known)}"
            )
        method = config.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"{option}: method {method!r} is not supported; expected one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        lookup = HYBRIDS.get(method, method if method in LOOKUP_KEYS else None)
        allowed = ("method", "num_speculative_tokens", "model", *LOOKUP_KEYS.get(lookup, ()))
        unknown = [key for key in config if key not in allowed]
        if unknown:
            raise ValueError(
                f"{option}: method {method!r} does not take the key {unknown[0]!r}; it takes "
                f"{', '.join(allowed)}"
            )
        model = config.get("model")
        if model is not None and model != target_model:
            raise ValueError(
                f"{option}: model {model!r} is a separate draft model, which spmoe does not "
                "support; MTP drafts with the served model's own layer, a lookup with none "
                "(leave model out)"
            )
        try:
            lookup_config = _lookup_config(lookup, config)
        except ValueError as e:
            raise ValueError(f"{option}: {e}") from None
        default = 1 if lookup is None else None
        if method == "suffix":
            default = lookup_config.max_tree_depth
        drafts = config.get("num_speculative_tokens", default)
        if not isinstance(drafts, int) or isinstance(drafts, bool) or drafts < 1:
            raise ValueError(
                f"{option}: method {method!r} needs num_speculative_tokens, an integer >= 1, got "
                f"{drafts!r}"
            )
        mtp = lookup is None or method in HYBRIDS
        return Speculation(num_speculative_tokens=drafts, mtp=mtp, lookup=lookup_config)

    @classmethod
    def checked_json(cls, text: str) -> dict:
        """`--speculative-config`'s JSON, checked as a whole (`parse`) while the command line is
        parsed."""
        config = parse_json_object(text, "--speculative-config")
        cls.parse(config)
        return config


def _lookup_config(lookup: str | None, config: dict) -> NgramConfig | SuffixConfig | None:
    """The lookup's settings from its keys in `config`: vLLM's defaults (n-gram: both bounds 5, one
    given sets the other)."""
    if lookup == "ngram":
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        low = low if low is not None else high if high is not None else 5
        return NgramConfig(
            prompt_lookup_min=low, prompt_lookup_max=high if high is not None else low
        )
    if lookup == "suffix":
        keys = LOOKUP_KEYS["suffix"]
        return SuffixConfig(
            **{key.removeprefix("suffix_decoding_"): config[key] for key in keys if key in config}
        )
    return None


# `--kv-cache-dtype`: vLLM's names -> spmoe's paged cache dtypes (fp8 is e4m3 with block scales).
KV_CACHE_DTYPE_NAMES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}


def parse_kv_cache_dtype(text: str) -> str:
    if text not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(
            f"--kv-cache-dtype: expected one of {', '.join(KV_CACHE_DTYPE_NAMES)}, got {text!r}"
            + (" (spmoe's FP8 cache is e4m3)" if text.startswith("fp8") else "")
        )
    return KV_CACHE_DTYPE_NAMES[text]


# `--dtype`: the names vLLM takes that spmoe computes in.
DTYPE_NAMES = {"auto": "auto", "bfloat16": "bfloat16", "float32": "float32", "float": "float32"}
HALF_NAMES = ("float16", "half")
CHECKPOINT_DTYPES = {
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float16": "bfloat16",
    "float8_e4m3fn": "bfloat16",
}


def parse_dtype(text: str) -> str:
    """`--dtype`: one of DTYPE_NAMES (returned as given; `resolve_dtype` settles it). float16 is
    refused: the DeepSeek-V3 family's activations can pass float16's largest value (65504), which
    turns the output into NaN (docs/vllm-compatibility.md), and spmoe's GPU kernels are built for
    bfloat16."""
    if text in HALF_NAMES:
        raise ValueError(
            f"--dtype: spmoe does not compute in float16 ({text}): the DeepSeek-V3 family's "
            f"activations can pass its largest value, 65504; use --dtype bfloat16 (auto picks it "
            f"on CUDA)"
        )
    if text not in DTYPE_NAMES:
        raise ValueError(f"--dtype: expected one of {', '.join(DTYPE_NAMES)}, got {text!r}")
    return text


def parse_device(text: str) -> str | None:
    """`--device`: auto (None: settled to cuda when a GPU is visible), cuda or cpu; vLLM's other
    devices are refused by name."""
    if text == "auto":
        return None
    if text not in ("cpu", "cuda"):
        raise ValueError(
            f"--device: spmoe runs on cuda or cpu, not {text}; give auto, cuda or cpu (auto: cuda "
            f"when a GPU is visible)"
        )
    return text


def resolve_dtype(text: str, raw_config: dict, device: str) -> str:
    """The compute dtype for `--dtype text`: `auto` is bfloat16 on CUDA; on the CPU the checkpoint's
    `torch_dtype` (`dtype` in newer configs) when it is float32, else bfloat16 for a bf16/fp16/FP8
    checkpoint, float32 when the config states none."""
    if DTYPE_NAMES[parse_dtype(text)] != "auto":
        return DTYPE_NAMES[text]
    if device == "cuda":
        return "bfloat16"
    stated = raw_config.get("torch_dtype") or raw_config.get("dtype")
    if stated is None:
        return "float32"
    if stated not in CHECKPOINT_DTYPES:
        raise ValueError(
            f"--dtype auto: the checkpoint's torch_dtype {stated!r} is not one spmoe computes in"
        )
    return CHECKPOINT_DTYPES[stated]


def served_model_names(names: list[str] | None, model: str) -> list[str]:
    """`--served-model-name A B ...` -> the names clients may ask for, the first one reported in
    responses; none given: the model as it was named on the command line."""
    if not names:
        return [model]
    if any(not name.strip() for name in names):
        raise ValueError(f"--served-model-name: names must not be empty, got {names!r}")
    return list(dict.fromkeys(names))


def check_quantization(method: str | None, raw_config: dict) -> None:
    """`--quantization`: only the method the checkpoint declares
    (`quantization_config.quant_method`), since spmoe does not quantize weights at load time."""
    if method is None:
        return
    declared = (raw_config.get("quantization_config") or {}).get("quant_method")
    if method != declared:
        stated = f"declares {declared}" if declared else "is not quantized"
        raise ValueError(
            f"--quantization {method}: spmoe does not quantize at load time and the checkpoint "
            f"{stated}; leave the flag "
            f"out{', or use a checkpoint stored in ' + method if method == 'fp8' else ''}"
        )


def block_size_note(size: int | None) -> str:
    """What to say of `--block-size size`: nothing for 64 (or none given), else that spmoe's
    blocks are 64 tokens, the size vLLM's MLA kernels (FlashMLA) take too."""
    if size is None or size == BLOCK_SIZE:
        return ""
    return (
        f"--block-size {size}: spmoe's paged cache has blocks of {BLOCK_SIZE} tokens only (vLLM "
        f"uses {BLOCK_SIZE} for MLA's paged cache too)"
    )
