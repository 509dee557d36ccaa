"""``python -m loopq.experiments``: the command is :mod:`loopq.commands.experiments` (this file is its entry point
only)."""

from loopq.commands.experiments import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
