"""benchmarks/check_readme_figures.py: the README's performance table against docs/performance.md's recorded
output, on the repository and on synthetic pages that must fail."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "check_readme_figures.py"

PERFORMANCE = """# Performance

## Serving (`bench_serve.py`)

Command: `python benchmarks/bench_serve.py --concurrency 64`. Machine: one H200. Date: 2026-12-02,
commit f0abf82.

```
 level   out tok/s  TTFT p50
  c=64      5676.9     433.8
```

## Sampling (`bench_sampler.py`)

Command: `python benchmarks/bench_sampler.py`. Machine: one H200. Date: 2026-12-02, commit 3d0529b.

```
 batch   sampled
   256     2.261
```
"""

README = """# x

## Performance

| What | Figure | Command | Machine | Date, commit |
|---|---|---|---|---|
| Served, 64 streams | {served} | `python benchmarks/bench_serve.py --concurrency 64` | one H200 | {when} |
| Sampled choice, batch 256 | 2.261 ms | `python benchmarks/bench_sampler.py` | one H200 | 2026-12-02, 3d0529b |

## Limits
"""


def run(readme: Path, performance: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--readme", str(readme), "--performance", str(performance)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def pages(tmp_path, served="5676.9 tok/s, TTFT p50 433.8 ms", when="2026-12-02, f0abf82"):
    readme, performance = tmp_path / "README.md", tmp_path / "performance.md"
    readme.write_text(README.format(served=served, when=when))
    performance.write_text(PERFORMANCE)
    return readme, performance


def test_the_repositorys_readme_figures_are_recorded():
    done = run(ROOT / "README.md", ROOT / "docs" / "performance.md")
    assert done.returncode == 0, done.stderr
    assert "rows of README.md's performance table are recorded" in done.stdout


def test_recorded_figures_pass(tmp_path):
    done = run(*pages(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "the 2 rows" in done.stdout


def test_a_figure_not_in_the_output_fails(tmp_path):
    done = run(*pages(tmp_path, served="5767.9 tok/s, TTFT p50 433.8 ms"))
    assert done.returncode == 1
    assert "Served, 64 streams: 5767.9 is not in the output recorded under" in done.stderr
    assert "433.8" not in done.stderr


def test_a_figure_inside_a_longer_number_fails(tmp_path):
    done = run(*pages(tmp_path, served="676.9 tok/s"))  # 5676.9 is in the output, 676.9 is not
    assert done.returncode == 1
    assert "676.9 is not in the output" in done.stderr


def test_a_wrong_commit_fails(tmp_path):
    done = run(*pages(tmp_path, when="2026-12-02, cd7f7af"))
    assert done.returncode == 1
    assert "does not name 'cd7f7af'" in done.stderr


def test_a_command_without_a_section_fails(tmp_path):
    readme, performance = pages(tmp_path)
    readme.write_text(readme.read_text().replace("--concurrency 64`", "--concurrency 256`"))
    done = run(readme, performance)
    assert done.returncode == 1
    assert "no section of the performance page holds the command" in done.stderr


def test_a_readme_without_the_table_fails(tmp_path):
    readme, performance = pages(tmp_path)
    readme.write_text("# x\n\nNo performance section.\n")
    done = run(readme, performance)
    assert done.returncode == 1
    assert "README has no '## Performance' section" in done.stderr
