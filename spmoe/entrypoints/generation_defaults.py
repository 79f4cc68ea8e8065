"""The model's own sampling defaults, as vLLM applies them (`--generation-config`): the checkpoint's
`generation_config.json` gives `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, and
`max_new_tokens` as the default `max_tokens`, for every field a request leaves out.

`--generation-config auto` (the default) reads the file from the model folder, `vllm` ignores it
(the OpenAI defaults), a folder path reads it from that folder.
`--override-generation-config '{...}'` sets fields over the file's.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# generation_config.json's name -> the request field it is the default of
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    # request field -> default, only those the model states
    values: dict = field(default_factory=dict)
    source: str = "none"  # where they came from, for the log

    @classmethod
    def load(
        cls, mode: str, model_dir: str | Path, overrides: dict | None = None
    ) -> "GenerationDefaults":
        """`mode`: "auto" (the model folder's file, if it has one), "vllm" (no file), or a folder
        that must hold generation_config.json. `overrides`: generation_config.json names set
        over the file's."""
        raw, source = {}, "none"
        if mode != "vllm":
            folder = Path(model_dir if mode == "auto" else mode)
            path = folder / "generation_config.json"
            if path.is_file():
                raw, source = _read(path), str(path)
            elif mode != "auto":
                raise ValueError(
                    f"--generation-config {mode}: expected a folder with "
                    "generation_config.json, found none"
                )
        if overrides:
            unknown = [key for key in overrides if key not in FIELDS]
            if unknown:
                raise ValueError(
                    f"--override-generation-config: {unknown[0]!r} is not one spmoe applies; "
                    f"expected some of {', '.join(FIELDS)}"
                )
            raw, source = {**raw, **overrides}, f"{source} + --override-generation-config"
        values = {}
        for name, request_field in FIELDS.items():
            value = raw.get(name)
            if value is None:
                continue
            _check(name, value, source)
            values[request_field] = value
        return cls(values, source)

    def apply(self, request: dict, given: set[str]) -> dict:
        """`request` (field -> value) with this model's default for every field not in `given` (the
        fields the client sent)."""
        return {
            **request,
            **{name: value for name, value in self.values.items() if name not in given},
        }

    def describe(self) -> str:
        """The defaults in force, for the log."""
        if not self.values:
            return "generation defaults: none from the model (OpenAI's defaults)"
        used = ", ".join(f"{name}={value}" for name, value in self.values.items())
        return f"generation defaults from {self.source}: {used} (a request's own fields win)"


def _read(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _check(name: str, value, source: str) -> None:
    """Raise unless `value` is a number in the range the request field takes."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if name in ("top_k", "max_new_tokens"):
        ok = (
            ok and isinstance(value, int) and (value >= 1 or (name == "top_k" and value in (0, -1)))
        )
    elif name == "top_p":
        ok = ok and 0 < value <= 1
    elif name == "min_p":
        ok = ok and 0 <= value <= 1
    elif name == "repetition_penalty":
        ok = ok and value > 0
    else:  # temperature
        ok = ok and value >= 0
    if not ok:
        raise ValueError(f"{source}: {name} = {value!r} is out of range")
