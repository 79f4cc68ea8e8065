"""An engine option's declaration: a dataclass field that carries its flags, its section of `--help`
and what argparse takes beside them (`option`), and `--help`'s sections in the order users look."""

import argparse
from dataclasses import field
from functools import partial

# `--help`'s sections, in the order users look for a flag
HELP_GROUPS = (
    "model", "parallelism", "memory and cache", "speculation and CUDA graphs", "chat and tools", "server",
    "logging",
)  # fmt: skip


def help_groups(parser: argparse.ArgumentParser) -> dict:
    """`parser`'s sections of `--help` by title (HELP_GROUPS), made on the first call; empty ones print
    nothing."""
    made = {group.title: group for group in parser._action_groups}
    return {title: made.get(title) or parser.add_argument_group(title) for title in HELP_GROUPS}


def option(default, *flags: str, section: str, help: str, cli_default=field, **argparse_kwargs):
    """A field with its `default` and its command line: its flag names (the first one names it in error
    messages; vLLM's names are aliases), its `section` of `--help` (one of HELP_GROUPS), what argparse
    takes beside them (type, choices, metavar, action), and, where the command line's default differs
    from the field's (an `auto` that `from_cli` settles), `cli_default`."""
    if section not in HELP_GROUPS:
        raise ValueError(f"{flags[0]}: section must be one of {HELP_GROUPS}, got {section!r}")
    meta = {"flags": flags, "section": section, "help": help, "argparse": argparse_kwargs}
    if cli_default is not field:
        meta["cli_default"] = cli_default
    return field(default=default, metadata=meta)


# the options of each engine section of `--help`
parallel_option = partial(option, section="parallelism")
model_option = partial(option, section="model")
memory_option = partial(option, section="memory and cache")
speculation_option = partial(option, section="speculation and CUDA graphs")
