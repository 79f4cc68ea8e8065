"""`python -m spmoe ...` is the `spmoe` command (torchrun starts it this way:
`torchrun ... -m spmoe generate`)."""

import sys

from spmoe.entrypoints.cli import main

sys.exit(main())
