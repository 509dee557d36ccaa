"""The GPU check's stages as the driver sees them: their names in the order they run (most important first) and
their time limits (:data:`LIMITS`), without importing the stages themselves (torch, Lightning, the models), so that
the command answers an option error or "no GPU" at once; :data:`STAGES` (the functions,
:mod:`loopq.commands.gpu_check.checks`) is imported when a stage's process asks for it."""

from __future__ import annotations

from typing import Any

from loopq.commands.gpu_check.driver import Limits

#: seconds per stage: quick cap, full cap, least worth starting with (:class:`~loopq.commands.gpu_check.driver.Limits`).
#: Estimates for one H100 (the first GPU run timed kernel tests and the step; the rest is to be confirmed): with the
#: default 480 s budget the quick check fits when the stages end well inside their caps, and stops in time otherwise.
LIMITS: dict[str, Limits] = {
    "environment": Limits(30, 30, 5),
    "calibration": Limits(120, 240, 40),
    "kernel-tests": Limits(150, 300, 60),
    "kernel-bench": Limits(120, 300, 30),
    "e2e": Limits(90, 300, 30),
    "pipeline": Limits(120, 240, 60),
    "paper-shape": Limits(180, 600, 90),
    "profile": Limits(60, 180, 20),
}


def __getattr__(name: str) -> Any:
    if name == "STAGES":
        from loopq.commands.gpu_check.checks import STAGES

        return STAGES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
