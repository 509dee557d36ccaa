"""One behaviour for every LoopQ command line: bad input ends with one line, not a traceback.

Every ``python -m loopq.<command>`` ends its ``__main__`` block with ``run_cli(main)``. A *user error* - anything
derived from :class:`LoopQError` (each package's own error class is one), an unreadable JSON / safetensors file, a
missing path, a refused command-line option - then prints ``error: <message>`` on one line of stderr and exits with
status 2 (argparse's status for bad usage), so a script or a scheduler sees a clear, short reason; Ctrl-C ends with
one line and status 130 (the shell's). Anything else is a bug and keeps its traceback. ``--debug`` anywhere on the
command line (or ``LOOPQ_DEBUG=1``) shows the traceback of user errors as well.

A command that fails after ``torch.distributed`` started (DDP, DeepSpeed) exits at once with its status
(``os._exit`` after flushing): a process group keeps threads alive (NCCL's watchdog) that made a failed run hang
until killed instead of exiting - the first GPU run's DeepSpeed setup crash. Checkpoints are written atomically, so
nothing a hard exit skips is lost.

The messages themselves are written where the error is raised: they name the file, option or config key and say
what to do. :func:`one_line` only folds multi-line messages (jsonargparse's nested ones) into a single line.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError

from loopq.config_yaml import ConfigYAMLError
from loopq.numerics import reproducible_cpu

DEBUG_FLAG = "--debug"
CONFIG_FLAG = "--config"
DEBUG_ENV = "LOOPQ_DEBUG"
EXIT_STATUS = 2
#: the shell's status for a command ended by Ctrl-C (128 + SIGINT)
INTERRUPT_STATUS = 130
INTERRUPTED = "interrupted (Ctrl-C); every file written so far is complete (atomic writes): run the command again"


class LoopQError(ValueError):
    """Bad input a user can fix (an option, config key or file); the message names it and says what to do.

    A ``ValueError``, so callers that caught the package's errors as ``ValueError`` still do."""


class LoopLMError(LoopQError):
    """Bad model input (config, checkpoint, arguments): the message names the file or key and the fix."""


class DataError(LoopQError):
    """Bad data input; the message names the file or key and what to do."""


class UsageError(LoopQError):
    """A command-line option with a bad value; the message names the option."""


class GuardError(LoopQError):
    """A command would overwrite something it reads, or cannot fit in memory; the message names the option."""


#: failures that mean bad input rather than a bug (:class:`LoopQError` covers every package error class)
USER_ERRORS: tuple[type[BaseException], ...] = (
    LoopQError,
    ConfigYAMLError,  # an alias bomb or a duplicate key in a config or option value (loopq.config_yaml)
    UnicodeDecodeError,  # a text file that is not text, e.g. a binary file passed as JSON
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    json.JSONDecodeError,
    SafetensorError,
    argparse.ArgumentError,  # jsonargparse's ArgumentError derives from it
    subprocess.CalledProcessError,  # a child command (it printed its own error line first)
)

#: lines of jsonargparse's nested messages that only frame the real error
_FRAME = re.compile(
    r"^(Does not validate against|Subtypes:|Errors:|Given value|Problem with given class_path|"
    r"Expected a <class 'NoneType'>|Not a valid subclass|Import path)"
)
_KEY = re.compile(r'^Parser key "[^"]+":\s*')
#: jsonargparse's refusal of ``nan`` / ``inf`` for a float option, which does not say why
_NOT_FINITE = re.compile(r"Expected a <class 'float'>\. Got value: ([+-]?(nan|inf|infinity))$", re.IGNORECASE)
#: jsonargparse's refusal of a value outside a restricted type (``PositiveInt``): ``... 0 does not conform to v>0``
_RESTRICTED = re.compile(r"Not of type \w+: (.+) does not conform to restriction v(.+)$")


def article(word: str) -> str:
    """``word`` with its indefinite article, for messages (``an export``, ``a student``, ``an int``)."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line."""
    if isinstance(err, subprocess.CalledProcessError):
        command = shlex.join(str(part) for part in err.cmd) if isinstance(err.cmd, list) else str(err.cmd)
        return f"`{command}` failed (exit status {err.returncode}); its error is printed above"
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror.lower()}"
    text = str(err)
    if isinstance(err, argparse.ArgumentError):
        text = _argument_error(text)
    return " ".join(text.split())


def _argument_error(text: str) -> str:
    """jsonargparse's nested message (``Parser key "model.quant": ... - Parser key "w_bits": Expected ...``) as
    ``--model.quant.w_bits: Expected ...``: the chain of keys, then the first line that is not framing."""
    keys = re.findall(r'Parser key "([^"]+)"', text)
    details = (_KEY.sub("", line.strip().removeprefix("- ")) for line in text.splitlines())
    detail = next((line for line in details if line and not _FRAME.match(line)), None)
    if not keys or detail is None:
        return text
    restricted = _RESTRICTED.search(detail)
    if restricted:
        return f"--{'.'.join(keys)} {restricted.group(1)}: must be {restricted.group(2)}"
    not_finite = _NOT_FINITE.search(detail)
    if not_finite:
        detail = f"{not_finite.group(1)} is not a finite number; pass a finite value"
    return f"--{'.'.join(keys)}: {detail}"


#: errors of the machine, not of LoopQ: a full disk or quota, a read-only file system - one line, not a traceback
#: (a forbidden path is a PermissionError, in USER_ERRORS)
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def user_error(err: BaseException) -> BaseException | None:
    """``err`` if it is a user error, else the first user error it was raised from (jsonargparse wraps the errors
    of the classes it instantiates, e.g. a ``QuantConfigError``, in a plain ``ValueError``), else None."""
    seen: set[int] = set()
    found: BaseException | None = err
    while found is not None and id(found) not in seen:
        if isinstance(found, USER_ERRORS):
            return found
        if isinstance(found, OSError) and found.errno in ENVIRONMENT_ERRNOS:
            where = f"{found.filename}: " if found.filename else ""
            return OSError(f"{where}{found.strerror}; free space (or make it writable) and run the command again")
        seen.add(id(found))
        found = found.__cause__
    return None


def debug_requested(argv: list[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def config_files(argv: list[str]) -> list[Path]:
    """The files named by ``--config FILE`` / ``--config=FILE`` in ``argv``."""
    after = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == CONFIG_FLAG]
    inline = [arg.split("=", 1)[1] for arg in argv if arg.startswith(f"{CONFIG_FLAG}=")]
    return [Path(value) for value in [*after, *inline]]


def yaml_problem(err: Exception) -> str:
    """A YAML parse error as ``<problem> at line L, column C`` (1-based), without PyYAML's ``"<unicode string>"``."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return problem if mark is None else f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def check_config_files(argv: list[str]) -> None:
    """Every ``--config`` file that exists holds a mapping of settings. jsonargparse refuses an empty one (or a list,
    a bare word) with ``Unexpected config:`` and its content, naming neither the file nor the fix, and a YAML syntax
    error (or a NUL byte) with PyYAML's ``"<unicode string>"`` for the file; a missing file it reports itself. Alias
    bombs and duplicate keys are refused naming the file (:func:`loopq.config_yaml.check_yaml`)."""
    import yaml

    from loopq.config_yaml import check_yaml

    for path in config_files(argv):
        try:
            text = path.read_text() if path.is_file() else "{}"
            check_yaml(text, f"{CONFIG_FLAG} {path}")
            data = yaml.safe_load(text)
        except ConfigYAMLError as err:
            raise UsageError(str(err)) from None
        except UnicodeDecodeError:  # jsonargparse's own message named neither the file nor the fix
            raise UsageError(f"{CONFIG_FLAG} {path}: not UTF-8 text; save it as UTF-8 (a YAML file)") from None
        except yaml.YAMLError as err:  # jsonargparse's message named no file ("<unicode string>", line 3)
            raise UsageError(f"{CONFIG_FLAG} {path}: not valid YAML ({yaml_problem(err)}); fix the file") from None
        if data is None:
            raise UsageError(
                f"{CONFIG_FLAG} {path}: the file is empty (no settings); write settings into it or leave it out"
            )
        if not isinstance(data, dict):
            raise UsageError(
                f"{CONFIG_FLAG} {path}: holds {article(type(data).__name__)}, not settings (`key: value` lines, as in "
                "configs/tiny.yaml)"
            )


def run_cli(main: Callable[[], object]) -> None:
    """Run a command's ``main()`` (which reads ``sys.argv``, with ``--debug`` removed from it): a user error exits
    with one ``error:`` line and status 2, Ctrl-C with one line and status 130, unless debugging was asked for.
    ``--config`` files are checked first (:func:`check_config_files`). The command owns its process, so the CPU
    code paths are pinned first (:func:`loopq.numerics.reproducible_cpu`; provenance records them)."""
    reproducible_cpu()
    debug = debug_requested(sys.argv[1:])
    sys.argv = [arg for arg in sys.argv if arg != DEBUG_FLAG]
    if debug:
        check_config_files(sys.argv[1:])
        main()
        return
    try:
        check_config_files(sys.argv[1:])
        main()
    except KeyboardInterrupt:
        print(f"error: {INTERRUPTED}", file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPT_STATUS) from None
    except Exception as err:
        found = user_error(err)
        if found is None:
            exit_if_distributed(1, traceback=True)
            raise
        print(f"error: {one_line(found)}", file=sys.stderr, flush=True)
        exit_if_distributed(EXIT_STATUS)
        raise SystemExit(EXIT_STATUS) from None


def exit_if_distributed(status: int, traceback: bool = False) -> None:
    """``os._exit(status)`` when a ``torch.distributed`` process group is up (module docstring), after printing the
    exception being handled (``traceback``) and flushing; otherwise return and let the caller exit normally."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return
    if traceback:
        import traceback as tb

        tb.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
