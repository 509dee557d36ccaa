"""DeepSpeed ZeRO for LoopQ calibration, on GPUs and (for testing) on CPUs.

Lightning's ``DeepSpeedStrategy`` refuses non-CUDA accelerators, insists that device indices equal local ranks
(CPU devices have no index) and passes ``root_device.index`` (``None`` on CPU) as the device rank. This subclass
lifts those CUDA-only checks and passes the local rank instead, so the same ZeRO-2/3 code path runs on CPU
processes over gloo (what the tests do) and on GPUs over NCCL (what real runs do)::

    trainer:
      strategy:
        class_path: loopq.calib.deepspeed.LoopQDeepSpeedStrategy
        init_args: {stage: 2}          # or 3; any DeepSpeedStrategy argument, or config: ds_config.json

What is specific to LoopQ:

* **SLT.** The student's parameter layout is fixed from ``prepare`` on (:mod:`loopq.quant.modules`), so the
  progressive schedule runs as under DDP: a promotion writes buffers only and DeepSpeed's optimizer never changes.
* **Resume.** Every checkpoint directory also gets a small ``loopq.json`` (mu_t, provenance) that ``loopq.fit``
  reads to check a resume. DeepSpeed checkpoints are directories (``checkpoints/last.ckpt/``); ``--ckpt_path last``
  finds them like files.
* **Sealed, weights-only checkpoints.** DeepSpeed loads its checkpoint files with a full unpickle; here it reads
  them weights-only (:func:`weights_only_deepspeed_loads`, its own few classes allowed). ``loopq.json`` is removed
  before DeepSpeed writes and written last with the sha256 of every other file; :meth:`LoopQDeepSpeedStrategy.
  load_checkpoint` verifies the whole directory before DeepSpeed opens anything (:mod:`loopq.calib.checkpoint_io`):
  a checksum catches a damaged or mixed directory, the weights-only read a crafted one.
* **ZeRO-3** partitions parameters: :func:`gathered` collects the student's for writing it at the end.
* **bf16-mixed** runs DeepSpeed's fp32 engine under torch autocast (its ``torch_autocast`` section) instead of its
  ``bf16`` mode, which would cast every parameter to bf16: the quantization parameters and their optimizer states
  stay fp32 as under DDP, and the frozen teacher keeps the dtype it was loaded in (``model.teacher_dtype``).
* **Gradient buckets sized to the model.** Lightning's default ``reduce_bucket_size`` (2e8 elements) makes ZeRO-2
  allocate two fp32 buffers of 800 MB each during every backward (ZeRO-3 one, for the whole run), while LoopQ trains
  a few million parameters (Ouro-2.6B: 21.19M): unless the strategy's ``reduce_bucket_size`` or a DeepSpeed config
  sets it, the bucket is capped at the trainable parameter count (one bucket then holds every gradient; the sums are
  the same). The memory plan counts the buckets (:func:`loopq.planning.memory.bucket_bytes`). Found by the paper-shape
  stage of the GPU check (session 25), whose training step was 19 % over its plan.
* **CPU start-up.** On first use DeepSpeed JIT-compiles a shared-memory all-reduce op for CPU processes
  (40-66 s; cached afterwards). It only speeds up CPU collectives; ``LOOPQ_DEEPSPEED_SHM=0`` skips it (plain gloo
  collectives, ~2 s start-up). The tests set it. GPUs never use the op.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies.deepspeed import _validate_device_index_selection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.nn import Module
from torch.optim import Optimizer

from loopq.calib.checkpoint_io import SIDECAR, CheckpointError, check_sealed, read_sidecar_state, write_sidecar

__all__ = ["SIDECAR", "LoopQDeepSpeedStrategy", "gathered", "is_zero3", "read_sidecar"]
#: set to 0 to skip DeepSpeed's JIT-compiled shared-memory op for CPU collectives
SHM_ENV = "LOOPQ_DEEPSPEED_SHM"


def disable_shm_comm() -> None:
    """Make DeepSpeed's torch backend skip building its CPU shared-memory comm op (falls back to gloo)."""
    import importlib

    # not ``import deepspeed.comm.torch as m``: ``deepspeed.comm`` has an attribute ``torch`` (the torch library)
    # which that statement would bind instead of the submodule
    backend = importlib.import_module("deepspeed.comm.torch")
    backend.build_shm_op = lambda: None


#: Lightning's default gradient bucket (``reduce_bucket_size``, elements), the cap :class:`LoopQDeepSpeedStrategy`
#: starts from
DEEPSPEED_BUCKET = 200_000_000


def sized_bucket(trainable: int, bucket: int = DEEPSPEED_BUCKET) -> int:
    """The gradient bucket of a run with ``trainable`` parameters: no larger than all of them (one bucket then holds
    every gradient), at least 1."""
    return max(1, min(bucket, trainable))


class LoopQDeepSpeedStrategy(DeepSpeedStrategy):
    strategy_name = "loopq_deepspeed"

    def __init__(self, *args: Any, reduce_bucket_size: int | None = None, **kwargs: Any) -> None:
        """Lightning's ``DeepSpeedStrategy``; ``reduce_bucket_size`` None (the default): sized to the trainable
        parameters at setup (module docstring), unless a DeepSpeed config (``config``) is given."""
        bucket = DEEPSPEED_BUCKET if reduce_bucket_size is None else reduce_bucket_size
        super().__init__(*args, reduce_bucket_size=bucket, **kwargs)
        self.size_buckets = reduce_bucket_size is None and not args and self._load_config(kwargs.get("config")) is None

    def setup_environment(self) -> None:
        # skip DeepSpeedStrategy's CUDA-only check; keep the DDP-level environment setup (-> setup_distributed)
        super(DeepSpeedStrategy, self).setup_environment()

    def setup_distributed(self) -> None:
        assert self.parallel_devices is not None
        if self.root_device.type != "cpu":  # CPU "devices" have no index to check against the local rank
            _validate_device_index_selection(self.parallel_devices)
        reset_seed()
        self.set_world_ranks()
        if os.environ.get(SHM_ENV, "1") == "0":
            disable_shm_comm()
        self._init_deepspeed_distributed()

    def _format_config(self) -> None:
        """``bf16-mixed`` (unless the config sets ``bf16`` itself): autocast to bf16 around the engine's forward,
        parameters fp32 (module docstring); everything else as Lightning formats it."""
        if self.config is not None and self.precision_plugin.precision == "bf16-mixed" and "bf16" not in self.config:
            self.config["bf16"] = {"enabled": False}
            self.config.setdefault("torch_autocast", {"enabled": True, "dtype": "bfloat16"})
        super()._format_config()

    def _device_rank(self) -> int:
        index = self.root_device.index
        return self.local_rank if index is None else index

    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:
        import deepspeed

        params = [p for p in model.parameters() if p.requires_grad]
        zero = (self.config or {}).get("zero_optimization")
        if self.size_buckets and isinstance(zero, dict):
            trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3 leaves placeholders
            zero["reduce_bucket_size"] = sized_bucket(trainable, zero.get("reduce_bucket_size", DEEPSPEED_BUCKET))
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=params,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        """DeepSpeed's save, sealed: the old sidecar goes first (a save cut short then has none), the new one is
        written when every rank's files are (module docstring)."""
        directory = Path(self.broadcast(filepath))
        if self.is_global_zero:
            (directory / SIDECAR).unlink(missing_ok=True)
        super().save_checkpoint(checkpoint, filepath, storage_options)
        self.barrier("loopq_checkpoint_files")
        if self.is_global_zero and "loopq" in checkpoint:
            write_sidecar(directory, {**checkpoint["loopq"], "global_step": checkpoint.get("global_step")})
        self.barrier("loopq_sidecar")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify the sealed directory (global rank 0 reads it; every rank gets the verdict) before DeepSpeed
        unpickles any of it; a single-file checkpoint (``load_full_weights``) goes through the weights-only
        checkpoint IO instead."""
        if Path(checkpoint_path).is_dir():
            problem = None
            if self.is_global_zero:
                try:
                    check_sealed(checkpoint_path)
                except CheckpointError as err:
                    problem = str(err)
            problem = self.broadcast(problem)
            if problem is not None:
                raise CheckpointError(problem)
        elif not (self.load_full_weights and self.zero_stage_3):
            raise CheckpointError(
                f"--ckpt_path {checkpoint_path}: not a DeepSpeed checkpoint directory; a run under "
                "LoopQDeepSpeedStrategy resumes from the directories it wrote (checkpoints/*.ckpt/)"
            )
        with weights_only_deepspeed_loads():
            return super().load_checkpoint(checkpoint_path, weights_only)


def deepspeed_checkpoint_classes() -> list[type]:
    """The classes DeepSpeed's ZeRO-2/3 checkpoints hold beyond tensors and plain containers (DeepSpeed 0.19: the
    optimizer states' loss scaler, ZeRO stage and fragment addresses): what a weights-only read may rebuild."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def weights_only_deepspeed_loads() -> Iterator[None]:
    """Inside the block DeepSpeed's checkpoint engine reads its files weights-only (it calls ``torch.load`` with
    ``weights_only=False``), with :func:`deepspeed_checkpoint_classes` allowed: the seal of a checkpoint directory
    is a checksum anyone can recompute, not a signature, and a bad-input review ran code from a re-sealed file
    through DeepSpeed's loader. A file holding anything else is refused in one line."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    original, allowed = TorchCheckpointEngine.load, deepspeed_checkpoint_classes()

    def load(engine: TorchCheckpointEngine, path: str, map_location: Any = None) -> Any:
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:  # torch's message names what it refused, past its general advice
            said = [ln.strip() for ln in str(err).splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
            reason = said[0][:160] if said else "a weights-only read refused it"
            raise CheckpointError(
                f"{path}: not readable weights-only ({reason}); LoopQ never unpickles a checkpoint fully - resume "
                "from a checkpoint directory a LoopQ run wrote"
            ) from None

    TorchCheckpointEngine.load = load
    try:
        yield
    finally:
        TorchCheckpointEngine.load = original


def read_sidecar(ckpt_path: str | os.PathLike | None) -> dict[str, Any] | None:
    """The LoopQ state sealed next to a DeepSpeed checkpoint directory, its seal checked (None for a single-file
    checkpoint); the files themselves are verified before DeepSpeed opens them."""
    if ckpt_path is None or not Path(ckpt_path).is_dir():
        return None
    return read_sidecar_state(Path(ckpt_path))


def is_zero3(strategy: Any) -> bool:
    """Whether ``strategy`` partitions parameters (DeepSpeed ZeRO stage 3): forwards become collectives."""
    return isinstance(strategy, DeepSpeedStrategy) and bool(strategy.config) and strategy.zero_stage_3


def gathered(strategy: Any, params: Iterable[torch.nn.Parameter]) -> contextlib.AbstractContextManager:
    """Full (unpartitioned) values of ``params`` inside the ``with`` block under ZeRO-3; a no-op otherwise.

    Collective under ZeRO-3: every rank must enter it.
    """
    if is_zero3(strategy):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)
    return contextlib.nullcontext()
