"""Test helpers: the ``loopq.fit`` subprocess driver, student comparisons, and test-only callbacks used through the
CLI (``class_path: tests.helpers...``)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import lightning as L
import torch
from safetensors.torch import load_file

from loopq.artifacts.layout import STUDENT_META as CONFIG
from loopq.artifacts.layout import STUDENT_WEIGHTS as WEIGHTS
from loopq.paths import REPO_ROOT

#: the tiny calibration recipe every end-to-end test starts from
FIT_CONFIGS = ("--config", "configs/tiny.yaml", "--config", "tests/configs/fit-test.yaml")


def run_fit(
    root: Path | None,
    *args: str,
    configs: Sequence[str] = FIT_CONFIGS,
    procs: int = 1,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``python -m loopq.fit <configs> --trainer.default_root_dir <root> <args>`` from the repository root, under
    ``torchrun`` (``torch.distributed.run``) when ``procs > 1``; ``env`` adds variables. ``root`` None: no
    ``--trainer.default_root_dir``, the config's ``runs/tiny`` under ``$LOOPQ_RUNS_DIR`` (tests/conftest.py). With
    ``check``, a failed run raises an AssertionError that shows the end of its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
    cmd = [*(launcher if procs > 1 else [sys.executable]), "-m", "loopq.fit", *configs]
    cmd += [*(["--trainer.default_root_dir", str(root)] if root is not None else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[:8])} ... failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return out


def read_student(root: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The weights and metadata of the student a run wrote to ``<root>/student``."""
    return load_file(str(root / "student" / WEIGHTS)), json.loads((root / "student" / CONFIG).read_text())


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    """Same keys, and every tensor of ``b`` within ``atol`` of ``a`` (``atol=0``: bit-identical)."""
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=atol, rtol=0, msg=key)


class KillAtStep(L.Callback):
    """SIGKILL the process right before optimizer step ``step`` starts: a real crash, no cleanup, no save."""

    changes_student = False  # not in the recorded config: the resumed segment runs without it

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

    changes_student = False

    def on_fit_end(self, trainer, pl_module) -> None:
        from safetensors.torch import save_file

        from loopq.artifacts.student import quant_state

        save_file(
            quant_state(pl_module.student),
            os.path.join(trainer.default_root_dir, f"rank{trainer.global_rank}.safetensors"),
        )


class RecordPrecision(L.Callback):
    """Write to ``path`` (JSON) the dtypes a calibration held its parts in: the teacher's parameters, the student's
    frozen group weights (and whether they are the teacher's storage), the trainable quantization parameters, their
    AdamW states, the cached teacher targets, the logits of the training steps (bf16 under autocast), and the losses."""

    changes_student = False

    def __init__(self, path: str) -> None:
        self.path = path
        self.losses: list[float] = []
        self.logits: set[str] = set()

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.student.lm_head.register_forward_hook(lambda m, a, out: self.logits.add(str(out.dtype)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        from loopq.quant import quant_groups, quant_parameters

        teacher = {p.untyped_storage().data_ptr() for p in pl_module.teacher.parameters()}
        frozen = [w for g in quant_groups(pl_module.student).values() for w in g.weights()]
        states = [t for s in trainer.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t)]
        targets = pl_module.targets
        record = {
            "teacher": sorted({str(p.dtype) for p in pl_module.teacher.parameters()}),
            "student_frozen": sorted({str(w.dtype) for w in frozen}),
            "frozen_shared": all(w.untyped_storage().data_ptr() in teacher for w in frozen),
            "quant_params": sorted({str(p.dtype) for p in quant_parameters(pl_module.student)}),
            "optimizer_states": sorted({str(t.dtype) for t in states if t.dim() > 0}),
            "targets": {k: str(getattr(targets, k).dtype) for k in ("values", "indices", "states")},
            "logits": sorted(self.logits),
            "losses": self.losses,
        }
        with open(self.path, "w") as f:
            json.dump(record, f)


class FailInSetup(L.Callback):
    """Raise in ``setup`` (a data error, as a crash in data-dependent initialisation would be)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from loopq.data.text import DataError

        raise DataError("injected failure in setup")


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under ``roots``: what a refused command must leave byte-identical."""
    files = [p for root in roots for p in sorted(root.rglob("*")) if p.is_file()]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def command(main, argv: list[str], capsys) -> tuple[int, str]:
    """Run ``main(argv)`` as a ``__main__`` block does (``run_cli``): its exit status and its one stderr line."""
    import pytest

    from loopq.errors import run_cli

    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: main(argv))
    err = "\n".join(line for line in capsys.readouterr().err.splitlines() if not line.startswith("Seed set"))
    assert "\n" not in err.strip() and err.startswith("error: "), err
    return ended.value.code, err.strip()


def gpt2_tokenizer_copy(model_dir: Path, out: Path) -> Path:
    """A copy of the model directory ``model_dir`` (config + weights) whose byte-level BPE ``tokenizer.json`` is
    written as GPT-2's ``encoder.json`` + ``vocab.bpe`` instead (LoopFormer's format; the same ids and merges)."""
    import shutil

    out.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, out / name)
    bpe = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    (out / "encoder.json").write_text(json.dumps(bpe["vocab"]), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    (out / "vocab.bpe").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return out
