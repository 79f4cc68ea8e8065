"""The server that several modules' tests share."""

import pytest

from spmoe.entrypoints.demo import CHECKPOINT
from tests.entrypoints.serve.test_serve import start_server


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """The URL of `spmoe serve` on the shipped demo checkpoint, one rank, with auto tool choice and
    room for a prompt that lists a tool's schema: the server of the client libraries' tests
    (openai-agents, instructor, pydantic-ai, litellm) and of the Responses API's."""
    log = tmp_path_factory.mktemp("demo_server") / "stderr.txt"
    proc, url = start_server(
        CHECKPOINT, log, "--tp", "1", "--enable-auto-tool-choice", "--max-model-len", "4096"
    )
    yield url
    proc.kill()
    proc.wait()
