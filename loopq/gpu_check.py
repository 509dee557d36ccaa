"""``python -m loopq.gpu_check``: :func:`loopq.commands.gpu_check.run_checks.main`, its result the exit status, with
one-line errors (:func:`loopq.errors.run_cli`)."""

from loopq.commands.gpu_check.run_checks import main
from loopq.errors import run_cli


def _exit_with_status() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    run_cli(_exit_with_status)
