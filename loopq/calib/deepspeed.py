"""DeepSpeed ZeRO for LoopQ calibration, on GPUs and (for testing) on CPUs.

Lightning's ``DeepSpeedStrategy`` refuses non-CUDA accelerators and passes ``root_device.index`` (``None`` on
CPU) as the device rank. This subclass lifts the accelerator check and passes the local rank instead, so the
same ZeRO-2/3 code path runs on CPU processes over gloo (what the tests do) and on GPUs (what real runs do).
Promoting SLT groups mid-run would need new optimizer parameters, which DeepSpeed cannot add: with DeepSpeed the
sharing-gap selection runs up front (``SharingGapReselection(upfront=True)``).
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.nn import Module
from torch.optim import Optimizer


class LoopQDeepSpeedStrategy(DeepSpeedStrategy):
    strategy_name = "loopq_deepspeed"

    def setup_environment(self) -> None:
        # skip DeepSpeedStrategy's CUDA-only check; keep the DDP-level environment setup
        super(DeepSpeedStrategy, self).setup_environment()

    def _device_rank(self) -> int:
        index = self.root_device.index
        return self.local_rank if index is None else index

    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:
        import deepspeed

        params = [p for p in model.parameters() if p.requires_grad]
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
