"""The tree tells the truth about itself: every file a docstring, comment or document names (`a/b.py`,
`docs/x.md`, `run.sh`) is a file of the project, and nothing cites the project's own issue numbers,
which its users cannot see (a figure cites its public source). The dated performance journal
(docs/performance-log/) keeps its history as it was written."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a path to a module, a document or a script, standing alone
REFERENCE = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|sh))(?![\w/-])")
ISSUE = re.compile(r"(\w*)\s+([Ii]ssues? #?\d+)")
# the projects whose issues a citation may name ("FlashInfer issue #2822")
OTHER_PROJECTS = {"vLLM", "SGLang", "FlashInfer", "PyTorch", "torch", "transformers", "xgrammar"}
JOURNAL = ROOT / "docs" / "performance-log"


def project_files() -> list[Path]:
    """The files that can name others: code, documents, configs (not the checkpoints' data)."""
    kinds = (".py", ".md", ".sh", ".json", ".toml")
    return sorted(
        path
        for folder in ("spmoe", "benchmarks", "tests", "docs")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in kinds
        and "checkpoints" not in path.parts
        and "__pycache__" not in path.parts
    ) + [ROOT / "README.md", ROOT / "pyproject.toml"]


def resolves(reference: str, source: Path, every_path: set[str]) -> bool:
    """Whether `reference` names a file of the project: from the root, from `spmoe/`, from the naming
    file's folder or a folder above it, or as the tail of a project path."""
    inside = [folder for folder in source.parents if folder == ROOT or ROOT in folder.parents]
    if any((base / reference).exists() for base in (ROOT, ROOT / "spmoe", *inside)):
        return True
    return any(path == reference or path.endswith("/" + reference) for path in every_path)


def stale_references(text: str, source: Path, every_path: set[str]) -> list[str]:
    found = []
    for match in REFERENCE.finditer(text):
        before = text[max(0, match.start() - 40) : match.start()]
        # an argument (`--out projection.md`), a URL or another project's source tree
        if re.search(r"--[\w-]+[ =]$|://\S*$|\bvllm/\S*$", before) or match.group(1).startswith(
            "vllm/"
        ):
            continue
        if not resolves(match.group(1), source, every_path):
            found.append(match.group(1))
    return found


def own_issues(text: str) -> list[str]:
    """The issue numbers `text` cites with no other project named before them."""
    return [issue for project, issue in ISSUE.findall(text) if project not in OTHER_PROJECTS]


def test_the_checks_find_what_they_look_for():
    every = {"spmoe/engine/cache/blocks.py"}
    source = ROOT / "spmoe" / "engine" / "scheduler.py"
    assert stale_references("see `block_manager.py` and `cache/blocks.py`", source, every) == [
        "block_manager.py"
    ]
    assert stale_references("python x.py --out projection.md", source, {"x.py"}) == []
    assert own_issues("as quoted in spmoe issue 39; FlashInfer issue #2822") == ["issue 39"]


def test_every_named_file_exists():
    files = project_files()
    every = {str(path.relative_to(ROOT)) for path in ROOT.rglob("*") if ".git" not in path.parts}
    stale = {
        f"{path.relative_to(ROOT)}: {reference}"
        for path in files
        if JOURNAL not in path.parents and path != Path(__file__)
        for reference in stale_references(path.read_text(), path, every)
    }
    assert len(files) > 200
    assert sorted(stale) == []


def test_no_citation_of_the_projects_own_issues():
    cited = [
        f"{path.relative_to(ROOT)}: {match}"
        for path in project_files()
        if JOURNAL not in path.parents and path != Path(__file__)
        for match in own_issues(path.read_text())
    ]
    assert cited == []
