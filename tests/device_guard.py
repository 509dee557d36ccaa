"""A second device on a CPU-only machine, for the bug class of the first GPU run (issue 27).

On a GPU, a tensor that LoopQ's code makes with a factory call (``torch.zeros``, ``torch.linspace``, ...) without
``device=`` lands on the CPU while the model is on cuda, and the first op that mixes them fails ("Expected all
tensors to be on the same device") - or a CPU index/copy silently round-trips through the host. On a CPU-only
machine both are the CPU and nothing fails. :class:`ElsewhereFactories` restores the distinction: every factory call
made *from the project's own code at run time* without a device lands on ``meta`` instead, a device the model is
not on, so the same mix fails here ("Tensor on device meta is not on the expected device cpu", "Cannot copy out of
meta tensor"). Module construction is exempt (inside an ``nn.Module.__init__``, parameters are made on the default
device and moved with the module, which is what a placement does); torch's, Lightning's and every library's calls
are untouched.

:class:`StrictDevices` switches it on for a ``loopq.fit`` run from the first ``setup`` hook (after the module was
built, before data-dependent initialisation) to ``teardown``::

    --trainer.callbacks+ '{"class_path": "tests.device_guard.StrictDevices"}'
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from loopq.paths import REPO_ROOT

FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.tensor,
    torch.as_tensor,
    torch.randn,
    torch.rand,
    torch.randint,
    torch.randperm,
}
#: the project's code; a factory call whose first caller outside torch is here is checked
PROJECT = tuple(str(REPO_ROOT / part) for part in ("loopq", "callbacks"))
TORCH = str(Path(torch.__file__).parent)


def _caller(frame: FrameType | None) -> FrameType | None:
    """The first frame outside torch (and outside this file)."""
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame


def _constructing(frame: FrameType | None) -> bool:
    """Inside an ``nn.Module.__init__`` (the module is built, then placed as a whole)."""
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), nn.Module):
            return True
        frame = frame.f_back
    return False


class ElsewhereFactories(TorchFunctionMode):
    """Factory calls of the project's run-time code without ``device=`` land on ``meta`` (module docstring).
    ``redirected`` lists their call sites (``file:line``)."""

    def __init__(self) -> None:
        super().__init__()
        self.redirected: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and not _from_tensor(func, args):
            frame = _caller(sys._getframe(1))
            if frame is not None and frame.f_code.co_filename.startswith(PROJECT) and not _constructing(frame):
                self.redirected.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
                kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _from_tensor(func: Any, args: tuple) -> bool:
    """``torch.as_tensor(t)`` / ``torch.tensor(t)`` of a tensor keep its device: not a placement decision."""
    return func in (torch.as_tensor, torch.tensor) and bool(args) and isinstance(args[0], torch.Tensor)


class StrictDevices(L.Callback):
    """:class:`ElsewhereFactories` from the first ``setup`` hook to ``teardown`` of a Lightning run."""

    def __init__(self) -> None:
        self.mode = ElsewhereFactories()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.mode.__enter__()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.mode.__exit__(None, None, None)


class DeviceClaimedBeforeMove(L.Callback):
    """What Lightning does on a GPU, on the CPU: ``LightningModule.device`` names another device than the one the
    parameters are on when ``setup`` runs (here ``meta``; on a GPU cuda while the tensors are still on the CPU)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module._device = torch.device("meta")
