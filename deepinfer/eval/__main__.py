"""`python -m deepinfer.eval TOOL [ARGS ...]`: runs deepinfer.eval.TOOL's main(ARGS)."""
from __future__ import annotations

import importlib
import sys

from deepinfer.eval import TOOLS

USAGE = f"usage: python -m deepinfer.eval {{{','.join(TOOLS)}}} [ARGS ...]  (ARGS: see TOOL --help)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if not argv or argv[0] not in TOOLS:
        got = f"unknown tool {argv[0]!r}" if argv else "no tool given"
        print(f"python -m deepinfer.eval: error: {got}; choose one of {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"deepinfer.eval.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
