"""How a command-line option is declared: its flag names, its section of `--help` and what argparse
takes beside them (`option` -> `Flag`), and `--help`'s sections in the order users look."""

import argparse
from dataclasses import dataclass, field
from functools import partial

# `--help`'s sections, in the order users look for a flag
HELP_GROUPS = (
    "model", "parallelism", "memory and cache", "speculation and CUDA graphs", "chat and tools",
    "server", "logging",
)  # fmt: skip
# a `Flag` whose command-line default is its field's
FIELD_DEFAULT = object()


def help_groups(parser: argparse.ArgumentParser) -> dict:
    """`parser`'s sections of `--help` by title (HELP_GROUPS), made on the first call; empty ones
    print nothing."""
    made = {group.title: group for group in parser._action_groups}
    return {title: made.get(title) or parser.add_argument_group(title) for title in HELP_GROUPS}


@dataclass(frozen=True)
class Flag:
    """One option on the command line: its flag `names` (the first names it in error messages;
    vLLM's names are aliases), its `section` of `--help` (one of HELP_GROUPS), its `help`, what
    argparse takes beside them (`argparse_kwargs`: type, choices, metavar, action) and, where the
    command line's default differs from the field's (an `auto` settled once the line is read),
    `cli_default`."""

    names: tuple[str, ...]
    section: str
    help: str
    argparse_kwargs: dict = field(default_factory=dict)
    cli_default: object = FIELD_DEFAULT

    def __post_init__(self):
        if self.section not in HELP_GROUPS:
            raise ValueError(
                f"{self.names[0]}: section must be one of {HELP_GROUPS}, got {self.section!r}"
            )

    def add_to(self, parser: argparse.ArgumentParser, dest: str, default) -> None:
        """This flag as an argument of `parser`, in its section, storing into `dest`; `default`:
        the field's, unless the command line has its own."""
        if self.cli_default is not FIELD_DEFAULT:
            default = self.cli_default
        group = help_groups(parser)[self.section]
        group.add_argument(
            *self.names, dest=dest, default=default, help=self.help, **self.argparse_kwargs
        )


def option(
    *names: str, section: str, help: str, cli_default=FIELD_DEFAULT, **argparse_kwargs
) -> Flag:
    return Flag(
        names=names,
        section=section,
        help=help,
        argparse_kwargs=argparse_kwargs,
        cli_default=cli_default,
    )


# the options of each engine section of `--help`
parallel_option = partial(option, section="parallelism")
model_option = partial(option, section="model")
memory_option = partial(option, section="memory and cache")
speculation_option = partial(option, section="speculation and CUDA graphs")
