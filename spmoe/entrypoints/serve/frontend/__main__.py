"""`python -m spmoe.entrypoints.serve.frontend`: a front end process, as rank 0 starts it
(`process.main`)."""

import os
import sys

from spmoe.entrypoints.serve.frontend.process import main

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # everything is closed; the interpreter's teardown (the tokenizer, the event loop's threads)
    # would hold the server's stop up
    os._exit(code)
