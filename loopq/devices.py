"""Which device a command computes on: ``--device`` of ``loopq.evaluate``, ``loopq.run``, ``loopq.experiments``,
``loopq.eval`` and ``loopq.generate``.

``auto`` (the default) is the first CUDA GPU when PyTorch sees one, else the CPU, so a user on a GPU machine
evaluates on the GPU without asking. An explicit ``cuda``/``cuda:N`` on a machine without CUDA is refused with one
line (not silently run on the CPU: a number would then be reported for another device than the one asked for).
Calibration (``loopq.fit``) takes its device from Lightning's ``trainer.accelerator`` / ``trainer.devices``.
Each command decides once, at its entry (the options of ``loopq.run``, the ``Sweep`` of ``loopq.experiments``),
and hands the resolved name down to its export checks and evaluations (which then only check an explicit name).
"""

from __future__ import annotations

import torch

from loopq.errors import UsageError

AUTO = "auto"


def resolve_device(name: str | torch.device | None = AUTO, option: str = "--device") -> torch.device:
    """``auto``/None -> ``cuda`` when available, else ``cpu``; ``cpu``, ``cuda``, ``cuda:N`` as given, checked."""
    if name is None or str(name) == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"{option} {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{option} {name}: PyTorch sees no CUDA device here; use {option} cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"{option} {name}: only {torch.cuda.device_count()} CUDA device(s); use cuda:0 ...")
    elif device.type != "cpu":
        raise UsageError(f"{option} {name}: LoopQ runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    return device
