"""Test-only callbacks used through the CLI (``class_path: tests.helpers...``)."""

import os
import signal

import lightning as L


class KillAtStep(L.Callback):
    """SIGKILL the process right before optimizer step ``step`` starts: a real crash, no cleanup, no save."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class KillOnceAtStep(KillAtStep):
    """:class:`KillAtStep` unless ``marker`` exists (it is created right before the kill): a re-run of the same config
    gets past the step."""

    def __init__(self, step: int, marker: str) -> None:
        super().__init__(step)
        self.marker = marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not os.path.exists(self.marker):
            if trainer.global_step == self.step:
                open(self.marker, "w").close()
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


class PoisonAtStep(L.Callback):
    """Write NaN into the student's first trainable parameter right before step ``step``: the loss goes NaN."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            param = next(p for p in pl_module.student.parameters() if p.requires_grad)
            param.data.fill_(float("nan"))


class SaveRankStudent(L.Callback):
    """At the end of fit, every rank writes its own copy of the student to ``<default_root_dir>/rank<r>.safetensors``
    (multi-process tests check that the ranks stayed identical)."""

    def on_fit_end(self, trainer, pl_module) -> None:
        from safetensors.torch import save_file

        from loopq.calib.student_io import quant_state

        save_file(
            quant_state(pl_module.student),
            os.path.join(trainer.default_root_dir, f"rank{trainer.global_rank}.safetensors"),
        )
