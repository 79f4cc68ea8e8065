"""Model resolution: a local folder, or a Hugging Face model id found in a Hugging Face cache laid out by hand
(models--ORG--NAME/snapshots/REV/..., refs/main), offline."""

import os
import subprocess
import sys

import pytest

from spmoe.entrypoints.model_source import resolve_model

REV = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"


def lay_out_cache(cache, repo: str = "org/tiny", weights: bool = True) -> None:
    """A Hugging Face hub cache holding `repo` at REV (the main branch) and at OLD (no branch points there)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    for rev, layers in ((REV, 2), (OLD, 1)):
        snap = root / "snapshots" / rev
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(f'{{"num_hidden_layers": {layers}}}')
        (snap / "tokenizer.json").write_text("{}")
        if weights:
            (snap / "model.safetensors").write_bytes(b"")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REV)


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_model_id_resolves_from_the_cache(tmp_path, offline):
    lay_out_cache(tmp_path)
    folder = resolve_model("org/tiny", download_dir=str(tmp_path))
    assert folder == tmp_path / "models--org--tiny" / "snapshots" / REV
    assert '"num_hidden_layers": 2' in (folder / "config.json").read_text()
    old = resolve_model("org/tiny", revision=OLD, download_dir=str(tmp_path))
    assert '"num_hidden_layers": 1' in (old / "config.json").read_text()


def test_a_local_folder_is_used_as_it_is(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        ValueError, match="expected a checkpoint folder or a Hugging Face model id, got a file"
    ):
        resolve_model(str(tmp_path / "config.json"))
    with pytest.raises(
        ValueError, match=r"^--model /no/such/dir: no such folder \(and not a Hugging Face"
    ):
        resolve_model("/no/such/dir")


@pytest.mark.parametrize(
    "name, kwargs, complaint",
    [
        (
            "org/absent",
            {},
            r"^--model org/absent: no such folder, and the Hugging Face cache .* lacks the snapshot",
        ),
        (
            "org/tiny",
            {"revision": "v9"},
            r"^--model org/tiny \(revision v9\): .* lacks the snapshot",
        ),
        (
            "bad id!/x",
            {},
            r"^--model bad id!/x: no such folder, and not a valid Hugging Face model id",
        ),
    ],
)
def test_an_id_that_cannot_be_resolved_is_one_line_naming_it(
    tmp_path, offline, name, kwargs, complaint
):
    lay_out_cache(tmp_path)
    with pytest.raises(ValueError, match=complaint) as e:
        resolve_model(name, download_dir=str(tmp_path), **kwargs)
    assert "HF_HUB_OFFLINE" in str(e.value) or "valid" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_snapshot_without_weights_serves_dummy_loads_only(tmp_path, offline):
    lay_out_cache(tmp_path, weights=False)
    with pytest.raises(ValueError, match=r"lacks \*\.safetensors; HF_HUB_OFFLINE is set"):
        resolve_model("org/tiny", download_dir=str(tmp_path))
    folder = resolve_model("org/tiny", download_dir=str(tmp_path), weights=False)
    assert (folder / "config.json").is_file()
    with pytest.raises(
        ValueError, match=r"^--tokenizer org/tiny: .* lacks tokenizer\.json or tokenizer_config"
    ):
        (folder / "tokenizer.json").unlink()
        resolve_model("org/tiny", download_dir=str(tmp_path), weights=False, option="--tokenizer")


def test_hf_home_and_hf_hub_offline_from_the_environment(tmp_path):
    """A fresh process reads HF_HOME and HF_HUB_OFFLINE as `spmoe serve` would."""
    lay_out_cache(tmp_path / "hub")
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = "from spmoe.entrypoints.model_source import resolve_model as r; print(r('org/tiny'))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "hub" / "models--org--tiny" / "snapshots" / REV)
