"""Where a model comes from: a local checkpoint folder, or a Hugging Face model id
(`zai-org/GLM-5.2`) found in the local Hugging Face cache or downloaded into it.

The cache is looked at first, without any network access: a complete snapshot there is used as it
is. Only when it is missing or incomplete, and `HF_HUB_OFFLINE` is not set, are the files downloaded
(`huggingface_hub`, whose cache folder follows `HF_HOME` / `HF_HUB_CACHE`). `download_dir` (vLLM's
`--download-dir`) replaces the cache folder.
"""

from pathlib import Path

CONFIG_FILES = ["config.json", "generation_config.json"]
WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]


def resolve_model(
    name: str,
    revision: str | None = None,
    download_dir: str | None = None,
    *,
    weights: bool = True,
    tokenizer: bool = True,
    option: str = "--model",
) -> Path:
    """A local folder as it is, or the snapshot folder of the Hugging Face model id `name` at
    `revision` (default: the main branch) holding its config, and its weights and tokenizer if
    asked. Raises ValueError with one line naming `name` when it is neither."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise ValueError(
            f"{option} {name}: expected a checkpoint folder or a Hugging Face model id, got a file"
        )
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ValueError(
            f"{option} {name}: no such folder (and not a Hugging Face model id, which is ORG/NAME)"
        )
    needed = {"config.json": ["config.json"]}
    if weights:
        needed["*.safetensors"] = ["*.safetensors"]
    if tokenizer:
        needed["tokenizer.json or tokenizer_config.json"] = [
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    patterns = (
        CONFIG_FILES + (WEIGHT_FILES if weights else []) + (TOKENIZER_FILES if tokenizer else [])
    )
    return _snapshot(name, revision, download_dir, patterns, needed, option)


def _snapshot(
    name: str,
    revision: str | None,
    download_dir: str | None,
    patterns: list[str],
    needed: dict,
    option: str,
) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    at = f" (revision {revision})" if revision else ""
    cache = download_dir or constants.HF_HUB_CACHE
    missing = ["the snapshot"]
    try:
        cached = Path(
            snapshot_download(
                name,
                revision=revision,
                cache_dir=download_dir,
                allow_patterns=patterns,
                local_files_only=True,
            )
        )
        missing = [
            what for what, globs in needed.items() if not any(any(cached.glob(g)) for g in globs)
        ]
        if not missing:
            return cached
    except HFValidationError as e:
        raise ValueError(
            f"{option} {name}: no such folder, and not a valid Hugging Face model id "
            f"({_first_line(e)})"
        ) from None
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"{option} {name}{at}: no such folder, and the Hugging Face cache {cache} lacks "
            f"{missing[0]}; HF_HUB_OFFLINE is set, so nothing is downloaded"
        )
    try:
        folder = Path(
            snapshot_download(
                name, revision=revision, cache_dir=download_dir, allow_patterns=patterns
            )
        )
    except (OSError, ValueError) as e:  # the hub's HTTP errors are OSErrors; connection errors too
        raise ValueError(
            f"{option} {name}{at}: no such folder, and the Hugging Face Hub did not provide it: "
            f"{type(e).__name__}: {_first_line(e)}"
        ) from None
    missing = [
        what for what, globs in needed.items() if not any(any(folder.glob(g)) for g in globs)
    ]
    if missing:
        raise ValueError(f"{option} {name}{at}: the Hugging Face repository has no {missing[0]}")
    return folder


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0]
