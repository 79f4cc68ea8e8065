"""The checkpoint's tokenizer as the server's processes load it (`spmoe.entrypoints.tokenizer`): a
plain fast tokenizer loads through transformers' fast class without torch and reads and writes text
as `AutoTokenizer`'s does; another class goes through `AutoTokenizer`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import spmoe
from spmoe.entrypoints.demo import write_demo_tokenizer
from spmoe.entrypoints.tokenizer import load_tokenizer

TEXTS = ["hi", "héllo wörld <|end|>", "def f(x):\n    return x  # é"]
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]


def test_a_folder_without_one_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="has no tokenizer: expected tokenizer.json"):
        load_tokenizer(tmp_path)


def test_a_plain_fast_tokenizer_loads_without_torch(tmp_path):
    write_demo_tokenizer(tmp_path)
    code = (
        "import sys; from spmoe.entrypoints.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(tmp_path)!r}); t.encode('hi'); "
        "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False); "
        "print('torch' in sys.modules)"
    )
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": root}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_it_reads_and_writes_text_as_auto_tokenizer_does(tmp_path):
    from transformers import AutoTokenizer

    write_demo_tokenizer(tmp_path)
    ours, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    assert ours.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    ) == auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, len(ours)) == (auto.eos_token_id, len(auto))


@pytest.mark.parametrize("shipped", [False, True])
def test_the_demo_tokenizer_splits_text_into_words(tmp_path, shipped):
    """The demo's tokens are the text's bytes, and its pre-tokenizer splits the text into words
    first, as real byte-level tokenizers do: the BPE model caches every piece it encodes (up to
    10,000), and whole prompts as pieces made a front end keep about 4 KiB of every distinct prompt
    it read."""
    folder = Path(spmoe.__file__).parent / "checkpoints" / "glm-stdlib-tiny"
    if not shipped:
        write_demo_tokenizer(folder := tmp_path)
    tokenizer = load_tokenizer(folder)
    text = "def f(x):\n    return x  # a word or two"
    assert tokenizer.encode(text) == list(text.encode())
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    assert len(pieces) >= 10 and "".join(piece for piece, _ in pieces) == text.replace(
        " ", "Ġ"
    ).replace("\n", "Ċ")


def test_another_class_goes_through_auto_tokenizer(tmp_path):
    write_demo_tokenizer(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "tokenizer_class": "GPT2Tokenizer"})
    )
    tokenizer = load_tokenizer(tmp_path)
    assert type(tokenizer).__name__ != "TokenizersBackend" and tokenizer.encode("hi")
