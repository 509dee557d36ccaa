"""``python -m loopq.export``: the command is :mod:`loopq.commands.export` (this file is its entry point only)."""

from loopq.commands.export import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
