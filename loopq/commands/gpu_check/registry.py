"""The GPU check's stages as the driver sees them: their names in the order they run (most important first) and
their time limits (:data:`LIMITS`), without importing the stages themselves (torch, Lightning, the models), so that
the command answers an option error or "no GPU" at once; :data:`STAGES` (the functions,
:mod:`loopq.commands.gpu_check.checks`) is imported when a stage's process asks for it."""

from __future__ import annotations

from typing import Any

from loopq.commands.gpu_check.driver import Limits

#: seconds per stage: quick cap, full cap, least worth starting with (:class:`~loopq.commands.gpu_check.driver.Limits`).
#: Measured on one H100 (2026-11-27, quick mode): environment 23.2 s, calibration 41.9, kernel-tests 100.1,
#: kernel-bench 58.1 (before its longer repetitions: ~80 expected), e2e 53.7; paper-shape was cut at 150 s in its
#: first training step (after a setup of unknown length: its output is recorded since), pipeline and profile have not
#: run. The default 480 s budget therefore reaches pipeline but rarely paper-shape: a 15-minute device lease runs
#: the check in two calls (docs/benchmarks.md, "On a GPU").
LIMITS: dict[str, Limits] = {
    "environment": Limits(45, 45, 5),
    "calibration": Limits(120, 240, 40),
    "kernel-tests": Limits(150, 300, 60),
    "kernel-bench": Limits(120, 300, 30),
    "e2e": Limits(90, 300, 30),
    "pipeline": Limits(120, 240, 60),
    "paper-shape": Limits(300, 600, 120),
    "profile": Limits(60, 180, 20),
}


def __getattr__(name: str) -> Any:
    if name == "STAGES":
        from loopq.commands.gpu_check.checks import STAGES

        return STAGES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
