"""The checkpoint's tokenizer, as both server processes load it: the front end to read and write
text, rank 0 to compile grammars over the vocabulary.

transformers' `AutoTokenizer` imports torch (its configuration classes do), which the front end must
not load. A checkpoint whose tokenizer is transformers' plain fast tokenizer (`tokenizer_class`
`PreTrainedTokenizerFast`, a `tokenizer.json`) is loaded through that class directly, which is what
`AutoTokenizer` would give and imports no torch; any other class goes through `AutoTokenizer`.
"""

import json
from pathlib import Path

# tokenizer classes that are transformers' fast tokenizer itself, with no behaviour of their own
PLAIN_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def tokenizer_class(folder: Path) -> str | None:
    """The class `tokenizer_config.json` names (None: no file, or it names none)."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        named = json.loads(config.read_text()).get("tokenizer_class")
    except (ValueError, AttributeError):
        return None
    return named if isinstance(named, str) else None


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None):
    """The checkpoint folder's tokenizer (`tokenizer.json` / `tokenizer_config.json`), with
    `chat_template` in place of its own if given; a one-line error if the folder has none or it does
    not load."""
    folder = Path(model_dir)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"{folder} has no tokenizer: expected tokenizer.json or tokenizer_config.json there"
        )
    plain = (folder / "tokenizer.json").is_file() and tokenizer_class(folder) in PLAIN_FAST_CLASSES
    try:
        if plain:
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(
            f"the tokenizer in {folder} does not load: {str(e).strip().splitlines()[0]}"
        ) from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
