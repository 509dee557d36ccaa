"""``python -m loopq.generate``: the command is :mod:`loopq.commands.generate` (this file is its entry point only)."""

from loopq.commands.generate import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
