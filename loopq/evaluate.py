"""``python -m loopq.evaluate``: the command is :mod:`loopq.commands.evaluate` (this file is its entry point only)."""

from loopq.commands.evaluate import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
