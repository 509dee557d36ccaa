"""``python -m loopq.report``: :func:`loopq.report.main` with one-line errors (:func:`loopq.errors.run_cli`)."""

from loopq.errors import run_cli
from loopq.report.cli import main

if __name__ == "__main__":
    run_cli(main)
