"""PerLoopDiagnostics measures each step once: a run that ends on a scheduled step wrote that step twice (the
schedule's measurement and the end of training's), so the report's last point was doubled."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from loopq.calib import diagnostics
from loopq.calib.diagnostics import PerLoopDiagnostics


def test_each_step_is_measured_once(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(diagnostics, "layer_loop_errors", lambda *args: calls.append(1) or [[0.5, 0.25]])
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(holdout=torch.zeros(2, 4, dtype=torch.long)),
        log_dir=str(tmp_path), default_root_dir=str(tmp_path), is_global_zero=True, loggers=[], global_step=0,
    )  # fmt: skip
    module = SimpleNamespace(student=torch.nn.Linear(1, 1), teacher=None, compute_device="cpu", num_loops=2)
    callback = PerLoopDiagnostics(every_n_steps=2)
    for step in (1, 2, 3):  # global_step after each batch: steps 1 and 3 are scheduled ((step - 1) % 2 == 0)
        trainer.global_step = step
        callback.on_train_batch_end(trainer, module, None, None, step - 1)
    callback.on_train_end(trainer, module)  # ends on the scheduled step 3: measured already
    trainer.global_step = 4
    callback.on_train_end(trainer, module)  # a later end (a resumed fit's) on an unmeasured step: measured
    rows = [json.loads(line) for line in (tmp_path / "loop_errors.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3, 4] and len(calls) == 3
    assert rows[0]["errors"] == [[0.5, 0.25]]
