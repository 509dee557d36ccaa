"""``python -m loopq.examine``: the command is :mod:`loopq.commands.examine` (this file is its entry point only)."""

from loopq.commands.examine import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
