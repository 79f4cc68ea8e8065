"""`spmoe --version` prints the package's version, as installed, and exits 0."""

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
