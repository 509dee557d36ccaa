"""``python -m loopq.fit``: the command is :mod:`loopq.commands.fit` (this file is its entry point only)."""

from loopq.commands.fit import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
