"""Argument types and the parser class shared by the command-line entry points (`deepinfer` and its
subcommands, `python -m deepinfer.entrypoints.bench_serve`): every usage error is one line and exit code 2."""
from __future__ import annotations

import argparse

USAGE_ERROR = 2  # argparse's exit code for a bad command line


class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (a bad type or choice, a missing argument) as one line, as every usage error;
    subcommands' parsers are of this class too (add_subparsers uses the parent's class)."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"deepinfer: error: {message}\n")


def port(text: str) -> int:
    """argparse type of a TCP port."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in 1..65535, got {text!r}")
    return value


def at_least_zero(kind: type):
    """argparse type: a number of `kind` >= 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = -1
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'} >= 0, "
                                             f"got {text!r}")
        return value
    return parse
