"""`spmoe --version` prints the package's version, as installed, and exits 0."""

import subprocess
import sys
from importlib.metadata import version

import pytest

import spmoe
from spmoe.entrypoints.cli import main


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"spmoe {version('spmoe')}\n"
    assert spmoe.__version__ == version("spmoe")  # the module and the package metadata agree


def test_version_from_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "spmoe.entrypoints.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out.strip() == f"spmoe {spmoe.__version__}"
