"""Check that every figure of the README's performance table is in the benchmark output recorded for it.

A row of the table under the README's `## Performance` heading reads
`| what | figure | command | machine | date, commit |`. Its section of docs/performance.md is the first `## `
section whose text (whitespace folded) holds the command. That section must name the row's machine, date
and commit, and each number of the figure cell must appear in one of the section's fenced output blocks as
a number of its own (`74.2` matches `74.2%`, not `174.2`; numbers inside words, like the 50 of `p50`, are
not figures).

    python benchmarks/check_readme_figures.py [--readme README.md] [--performance docs/performance.md]

Prints one line per figure found; exit status 0 when all are, else 1 with one line per problem.
"""

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def fold(text: str) -> str:
    return " ".join(text.split())


def table_rows(readme: str) -> list[list[str]]:
    """The cells of each body row of the table under `## Performance`."""
    section = re.search(r"^## Performance\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    if section is None:
        raise ValueError("README has no '## Performance' section")
    lines = [line for line in section.group(1).splitlines() if line.startswith("|")]
    if len(lines) < 3:
        raise ValueError(
            f"expected a table of a header, a separator and rows, got {len(lines)} lines"
        )
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    for row in rows:
        if len(row) != 5:
            raise ValueError(
                f"expected 5 cells (what, figure, command, machine, date and commit), got {len(row)}: "
                f"{' | '.join(row)}"
            )
    return rows


def sections(performance: str) -> list[str]:
    """docs/performance.md cut at each `## ` heading."""
    return re.split(r"^(?=## )", performance, flags=re.M)


def problems_of_row(row: list[str], performance_sections: list[str]) -> list[str]:
    what, figure, command, machine, when = row
    command = command.strip("`")
    found = [s for s in performance_sections if fold(command) in fold(s)]
    if not found:
        return [f"{what}: no section of the performance page holds the command `{command}`"]
    section = found[0]
    heading = section.splitlines()[0]
    problems = [
        f"{what}: {heading!r} does not name {fact!r}"
        for fact in [machine, *(part.strip() for part in when.split(","))]
        if fact not in fold(section)
    ]
    numbers = FIGURE_NUMBER.findall(figure)
    if not numbers:
        problems.append(f"{what}: the figure cell {figure!r} holds no number")
    outputs = "\n".join(FENCED.findall(section))
    for number in numbers:
        if not re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", outputs):
            problems.append(f"{what}: {number} is not in the output recorded under {heading!r}")
    return problems


def check(readme: str, performance: str) -> tuple[int, list[str]]:
    """The number of rows checked and the problems found (none: every figure is recorded)."""
    rows = table_rows(readme)
    performance_sections = sections(performance)
    problems = [p for row in rows for p in problems_of_row(row, performance_sections)]
    return len(rows), problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--performance", type=Path, default=ROOT / "docs" / "performance.md")
    args = parser.parse_args(argv)
    try:
        rows, problems = check(args.readme.read_text(), args.performance.read_text())
    except (OSError, ValueError) as e:
        print(f"check_readme_figures: {e}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"check_readme_figures: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(
        f"check_readme_figures: the {rows} rows of {args.readme.name}'s performance table are recorded"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
