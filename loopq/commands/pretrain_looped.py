"""``loopq.pretrain`` for the two other looped families of the paper: LoopFormer and Parcae teachers.

    python -m loopq.pretrain --config configs/pretrain/tiny-loopformer.yaml   (architecture: loopformer)
    python -m loopq.pretrain --config configs/pretrain/tiny-parcae.yaml       (architecture: parcae)

The data, optimiser, schedule, resumption (``--ckpt_path last``) and record are :mod:`loopq.commands.pretrain`'s; the
model is built from a native ``config.json`` dict (``model.config``) and written in that architecture's native format
(what :func:`loopq.models.load_looplm` reads). Both objectives are multi-exit, as Ouro's (paper §2, Eq. 1 read out
after every loop t):

    L = sum_{t<R} w_t CE(head(H_t), y),     w_t proportional to ``loop_weights[t]`` over the loops actually run

with ``head`` the architecture's own read-out (LoopFormer: norm_f + tied wte; Parcae: C -> coda -> ln_f -> lm_head).
What each family adds:

* **LoopFormer** (time/budget conditioning): a training step draws a *budget* R from ``budgets`` and runs the uniform
  schedule dt_r = 1/R (so loop r is conditioned on tau_r = r/R and dt = 1/R, paper's elastic depth). Simplification of
  upstream: no shortcut-consistency term between a short and a long trajectory; the budgets are trained by the same
  multi-exit CE. Validation and the exported default use ``loopq_default_loops`` uniform loops.
* **Parcae** (randomised recurrence depth): a training step draws its depth R ~ Poisson(``mean_recurrence``) truncated
  to [1, ``max_depth``] (upstream's ``poisson-truncated-full`` sampling, per step instead of per sequence), from a
  generator seeded by (seed, step), so a resumed run draws the same depths. Simplification of upstream: the gradient
  flows through every iteration (upstream truncates back-propagation to the last ``mean_backprop_depth``), and every
  exit is supervised (upstream supervises the last only), so the early loops are trained read-outs.

``model.exits``: ``all`` (default) is the multi-exit objective above; ``last`` supervises only the read-out after a
step's last loop, L = CE(head(H_R), y), as upstream LoopFormer (each budget's final output) and Parcae (the last
iteration) train: the early exits are then not trained read-outs, and the loops must build the prediction together.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from loopq.commands.pretrain import LoopedPretrainer, check_save_dtype, loop_weight_tensor, step_generator
from loopq.errors import UsageError
from loopq.models.base import LoopLM
from loopq.models.loopformer import LoopFormerLM
from loopq.models.parcae import ParcaeLM


def exit_token_losses(model: LoopLM, ids: Tensor, num_loops: int, **kwargs: Any) -> Tensor:
    """Token-level CE ``[R, B, S]`` of the model's own read-out after every loop (``ids`` ``[B, S+1]``: inputs then
    the next tokens). The last entry is exactly the loss of ``model(ids[:, :-1], num_loops, **kwargs).logits``."""
    inputs, targets = ids[:, :-1], ids[:, 1:]
    h, ctx = model.embed(inputs, num_loops, **kwargs)
    ctx["num_loops"] = num_loops
    losses = []
    for t in range(num_loops):
        h, _ = model.loop_body(h, t, ctx, False)
        logits = model.head(h, ctx).float()
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets))
    return torch.stack(losses)


def exit_weights(weights: Tensor, num_loops: int) -> Tensor:
    """The first ``num_loops`` loop weights, normalised to sum 1 (the exits a step with that depth has)."""
    if num_loops > len(weights):
        raise ValueError(f"{num_loops} loops but only {len(weights)} loop weights")
    w = weights[:num_loops]
    return w / w.sum()


#: ``model.exits``: which read-outs the objective supervises
EXITS = ("all", "last")


def exit_loss(per_loop: Tensor, weights: Tensor, exits: str) -> Tensor:
    """The objective from a step's per-loop mean CEs ``[R]``: their ``weights``-weighted sum over the loops run
    (``exits == "all"``) or the last one alone (``"last"``)."""
    if exits == "last":
        return per_loop[-1]
    return (exit_weights(weights, len(per_loop)) * per_loop).sum()


def check_exits(exits: str, loop_weights: list[float] | None) -> None:
    if exits not in EXITS:
        raise UsageError(f"model.exits={exits!r}: use one of {EXITS}")
    if exits == "last" and loop_weights is not None:
        raise UsageError("model.loop_weights weighs the exits of model.exits=all; with exits=last drop it")


def truncated_poisson(mean: float, low: int, high: int, generator: torch.Generator) -> int:
    """One draw of Poisson(``mean``) conditioned on [low, high]: inverse-CDF sampling of the renormalised pmf
    p(k) = e^-mean mean^k / k! on that range (computed in log space)."""
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got [{low}, {high}]")
    ks = torch.arange(low, high + 1, dtype=torch.float64)
    log_p = ks * math.log(mean) - mean - torch.lgamma(ks + 1)
    p = torch.softmax(log_p, dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    return int(ks[min(int(torch.searchsorted(p.cumsum(0), u, right=True)), len(ks) - 1)])


class _NativePretrainer(LoopedPretrainer):
    """Shared by the LoopFormer and Parcae pretrainers: the multi-exit CE over a step's loops, logged per loop."""

    model: LoopLM

    def _depth(self, stage: str) -> tuple[int, dict[str, Any]]:
        """(loops, forward kwargs) of this step; validation always runs the default."""
        raise NotImplementedError

    def _objective(self, batch: list[Tensor], stage: str) -> tuple[Tensor, Tensor]:
        loops, kwargs = self._depth(stage)
        per_loop = exit_token_losses(self.model, batch[0], loops, **kwargs).mean(dim=(1, 2))
        loss = exit_loss(per_loop, self.loop_weights, self.hparams.exits)
        if stage == "val" or loops == self.model.default_num_loops:
            for t, value in enumerate(per_loop):
                self.log(f"{stage}/ce_loop{t + 1}", value, prog_bar=(stage == "val" or t == loops - 1))
        if stage == "train":
            self.log("train/loops", float(loops))
        return loss, per_loop


class LoopFormerPretrainer(_NativePretrainer):
    """Multi-exit pretraining of a LoopFormer with sampled uniform budgets (module doc)."""

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        vocab_size: int = 2048,
        budgets: list[int] | None = None,
        exits: str = "all",
        loop_weights: list[float] | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        seed: int = 0,
        out_dir: str = "loopq/assets/tiny-loopformer",
        save_dtype: str = "float32",
    ) -> None:
        """The LoopFormer to build and how it is trained.

        Args:
            config: the native LoopFormer config.json fields (vocab_size comes from the data)
            vocab_size: vocabulary size (linked to data.vocab_size)
            budgets: loop counts a training step draws from (default: only loopq_default_loops)
            exits: supervise every loop's read-out (all) or only a step's last one (last, as upstream)
            loop_weights: per-loop weights of the multi-exit loss (default: (t+1)^2, normalised over a step's loops)
            lr: peak learning rate
            weight_decay: AdamW weight decay of the matrices
            warmup_steps: linear warm-up steps
            min_lr_ratio: the cosine schedule's final learning rate as a fraction of lr
            seed: seed of the initialisation and of the budget draws
            out_dir: where the trained model, tokenizer and record are written
            save_dtype: dtype of the written weights: float32 or bfloat16
        """
        super().__init__()
        self.save_hyperparameters()
        check_save_dtype(save_dtype)
        check_exits(exits, loop_weights)
        native = {"model_type": "loopformer", "architectures": ["LoopFormerGPTForCausalLM"], **(config or {})}
        self.model = LoopFormerLM.from_config({**native, "vocab_size": vocab_size}, seed=seed)
        default = self.model.default_num_loops
        self.budgets = list(budgets or [default])
        if any(not isinstance(b, int) or b < 1 or b > default for b in self.budgets):
            raise UsageError(f"model.budgets={budgets}: loop counts between 1 and loopq_default_loops={default}")
        self.init_training(loop_weight_tensor(loop_weights, default, shortest=min(self.budgets)))

    def _depth(self, stage: str) -> tuple[int, dict[str, Any]]:
        if stage != "train" or len(self.budgets) == 1:
            loops = self.model.default_num_loops if stage != "train" else self.budgets[0]
        else:
            gen = step_generator(self.hparams.seed, self.global_step)
            loops = self.budgets[int(torch.randint(len(self.budgets), (), generator=gen))]
        return loops, {"steps": [1.0 / loops] * loops}


class ParcaePretrainer(_NativePretrainer):
    """Multi-exit pretraining of a Parcae with a randomised recurrence depth (module doc)."""

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        vocab_size: int = 2048,
        max_depth: int | None = None,
        exits: str = "all",
        loop_weights: list[float] | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        seed: int = 0,
        out_dir: str = "loopq/assets/tiny-parcae",
        save_dtype: str = "float32",
    ) -> None:
        """The Parcae to build and how it is trained.

        Args:
            config: the native Parcae config.json fields (vocab_size comes from the data)
            vocab_size: vocabulary size (linked to data.vocab_size)
            max_depth: the truncation of the sampled depth (default 2 x mean_recurrence)
            exits: supervise every loop's read-out (all) or only a step's last one (last, as upstream)
            loop_weights: per-loop weights of the multi-exit loss, one per loop up to max_depth (default: (t+1)^2)
            lr: peak learning rate
            weight_decay: AdamW weight decay of the matrices
            warmup_steps: linear warm-up steps
            min_lr_ratio: the cosine schedule's final learning rate as a fraction of lr
            seed: seed of the initialisation and of the depth draws
            out_dir: where the trained model, tokenizer and record are written
            save_dtype: dtype of the written weights: float32 or bfloat16
        """
        super().__init__()
        self.save_hyperparameters()
        check_save_dtype(save_dtype)
        check_exits(exits, loop_weights)
        native = {"_class_name": "ParcaeConfig", "model_class_name": "Parcae", **(config or {})}
        native.update(vocab_size=vocab_size, padded_vocab_size=vocab_size)
        self.model = ParcaeLM.from_config(native, seed=seed)
        mean = self.model.default_num_loops
        self.max_depth = max_depth or 2 * mean
        if self.max_depth < mean:
            raise UsageError(f"model.max_depth={max_depth}: at least mean_recurrence={mean}")
        self.init_training(loop_weight_tensor(loop_weights, self.max_depth, shortest=1))  # depths from 1 are drawn

    def _depth(self, stage: str) -> tuple[int, dict[str, Any]]:
        mean = self.model.default_num_loops
        if stage != "train":
            return mean, {}
        gen = step_generator(self.hparams.seed, self.global_step)
        return truncated_poisson(float(mean), 1, self.max_depth, gen), {}
