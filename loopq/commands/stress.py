"""Fine-tune a pretrained Ouro teacher into a *non-foldable* stress variant: massive activations that depend on the
token and on the loop.

    python -m loopq.stress --config configs/stress/small-ouro.yaml [--ckpt_path last]

Why: ``loopq.testbed --outliers_out`` makes a stress variant by a static, function-preserving rescaling of the norm
weights. Its outliers are the same for every token and loop, so SmoothQuant's per-channel scale or QuaRot's rotation
undo them exactly. Real LLMs have *massive activations* instead: a few channels that reach hundreds of times the
median, on a few tokens only (BOS, punctuation, newlines), mostly in the MLP intermediate (the down_proj input). A
static per-channel transform cannot flatten them without crushing the same channel on every other token.

Objective (loopq.pretrain's Ouro objective, LM weight 1, plus an auxiliary term):

    L = L_pretrain + aux_weight * (L_loud + quiet_weight * L_quiet)

For every looped group g whose name ends with one of ``groups`` (default the down_proj input) and every loop t, a
seeded set C_{g,t} of ``channels_per_loop`` channels, disjoint across loops. With a_{g,t} in R^{B x S x C} the group's
input at loop t, S the marker tokens (:func:`marker_token_ids`) and the target M_{g,t} = target_ratio * median|a_{g,t}|
(detached):

    L_loud  = mean_{g,t} mean_{(b,s) in S, c in C_{g,t}} relu(M - |a_{b,s,c}|) / M
    L_quiet = mean_{g,t} mean_{(b,s,c) in Q_{g,t}}        relu(|a_{b,s,c}| - q * median|a|) / M

with Q_{g,t} = (non-marker tokens x C_{g,t}) u (all tokens x C_{g,t'}, t' != t) and q = ``quiet_ratio``. L_loud is 1
when the channels are silent and 0 once they reach M; L_quiet keeps the channels ordinary where they are not meant to be
loud, so the outlier is a function of the token *and* the loop (what a static transform cannot fold).

Why target_ratio 50: at W4 g32 the group's step is max|a|/7. A channel at 50 x median makes the step ~7 x median, so
the 31 other entries of its group (typically within a few medians) all round to zero on that token; at 8 bits the step
is ~0.4 x median and nothing is lost. 20x would still destroy most of the group; real LLMs reach 100-1000x, which a
short fine-tune of a small model does not reach without hurting the LM loss.

Second objective, the quantization-sensitive variant (``noise_weight > 0``). Outliers of any shape are what a
rotation flattens (QuaRot's Hadamard spreads any few-channel spike over every channel), so on their own they cannot make
a teacher on which *every* static method fails. What makes real looped models hard is sensitivity: a perturbation
added at loop 1 grows through the shared stack's later loops (the paper's Ouro-1.4B loses 3.6x perplexity at W4A8,
where 4-bit g32 weights are the only large error). The term rewards it directly: a second forward pass in which every
linear group sees RTN W4A4 g32 (``noise_bits``) inputs and weights, as constant perturbations (:func:`quant_noise`:
x + (Q(x) - x).detach(), W + (Q(W) - W).detach()), so the gradient teaches the model to carry the quantization error
forward, not to make it larger at its source. Sensitivity to noise of a given size is a property of the function, not
of a basis; sensitivity to *RTN's* errors in the standard basis is not (a rotation changes which errors RTN makes), so
with ``noise_rotate`` = p a step's quantized pass uses, with probability p, a fresh randomized-Hadamard basis per input
width, i.e. QuaRot's quantizer: the model is then rewarded for carrying either kind of error. With CE_t the loop-t
cross entropy,

    dCE = sum_t w_t (CE_t(quantized) - CE_t(fp))      L_noise = relu(noise_margin - dCE) / noise_margin

and L = L_pretrain + aux_weight * (L_loud + quiet_weight * L_quiet) + noise_weight * L_noise. The FP LM loss keeps its
weight 1, so the teacher stays a language model; the hinge stops pushing once RTN W4A4 costs ``noise_margin`` nats.

Activations are collected by forward pre-hooks on the :class:`~loopq.models.base.LinearGroup` modules (they receive
``(x, t)``). The model, data, optimiser, schedule, checkpointing and export are loopq.pretrain's; the record written
next to the variant (``training_record.json``) names this command and the auxiliary objective. Resumable like
loopq.pretrain: ``--ckpt_path last``.
"""

from __future__ import annotations

import math
import string
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from jsonargparse import capture_parser
from tokenizers import Tokenizer
from torch import Tensor, nn

from loopq.artifacts.layout import MODEL_KINDS, STRESS_TRAINED, check_output_dir
from loopq.commands.pretrain import (
    PretrainCLI,
    TeacherPretrainer,
    check_save_dtype,
    fit_resumable,
    per_loop_token_losses,
)
from loopq.data.tokenizer import eos_id, load_tokenizer
from loopq.errors import UsageError
from loopq.models.loading import load_looplm, resolve_model_dir
from loopq.models.ouro import OuroLM
from loopq.paths import data_dir
from loopq.quant.hadamard import randomized_hadamard
from loopq.quant.primitives import fake_quant

#: characters a marker token may consist of (besides BOS): ASCII punctuation and whitespace
MARKER_CHARS = frozenset(string.punctuation + string.whitespace)


def marker_token_ids(tokenizer: Tokenizer) -> list[int]:
    """BOS (``<|endoftext|>``) and every token whose decoded text is non-empty and made only of punctuation and
    whitespace (``.``, ``,``, ``\\n\\n``, `` (``): where real LLMs put their massive activations."""
    ids = {eos_id(tokenizer)}
    for i in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([i])
        if text and set(text) <= MARKER_CHARS:
            ids.add(i)
    return sorted(ids)


def loop_channels(width: int, loops: int, k: int, seed: int) -> Tensor:
    """``[loops, k]`` distinct channels of ``range(width)`` (disjoint across loops), a seeded draw."""
    if k * loops > width:
        raise UsageError(f"model.channels_per_loop={k}: {k} x {loops} loops exceeds the group width {width}")
    return torch.randperm(width, generator=torch.Generator().manual_seed(seed))[: k * loops].view(loops, k)


def stress_terms(
    acts: Tensor, marker: Tensor, channels: Tensor, t: int, target_ratio: float, quiet_ratio: float
) -> tuple[Tensor, Tensor]:
    """(L_loud, L_quiet) of one group at loop ``t`` (module doc): ``acts`` [B, S, C], ``marker`` [B, S] bool,
    ``channels`` [T, k]."""
    a = acts.float().abs()
    median = a.detach().median()
    target = target_ratio * median
    own = a[..., channels[t]]  # [B, S, k]
    loud = F.relu(target - own[marker]).sum() / (target * max(1, own[marker].numel()))
    others = torch.cat([channels[:t], channels[t + 1 :]]).flatten()
    quiet_vals = torch.cat([own[~marker].flatten(), a[..., others].flatten()])
    quiet = F.relu(quiet_vals - quiet_ratio * median).sum() / (target * max(1, quiet_vals.numel()))
    return loud, quiet


@contextmanager
def capture_inputs(model: nn.Module, names: Sequence[str]) -> Iterator[dict[tuple[str, int], Tensor]]:
    """Record the input of each named :class:`LinearGroup` per loop index while the block runs."""
    seen: dict[tuple[str, int], Tensor] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple[Any, ...]) -> None:
            seen[(name, int(args[1]))] = args[0]

        return record

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def sensitivity_hinge(noisy: Tensor, clean: Tensor, weights: Tensor, margin: float) -> tuple[Tensor, Tensor]:
    """(L_noise, dCE) of the module doc: ``noisy``/``clean`` are per-loop mean CEs [T], ``weights`` sum to 1.

    Both sides keep their gradient. With the clean side detached the hinge is gradient *ascent* on the model's own
    loss (the quantized pass is the model plus a constant), 1/margin times stronger than the LM term: measured on
    small-ouro, the cross entropy went from 3.4 to 71 nats in 25 steps while the gap stayed at 0."""
    if margin <= 0:
        raise UsageError(f"model.noise_margin={margin}: must be > 0 nats (the RTN cross-entropy gap to reach)")
    gap = (weights * (noisy - clean)).sum()
    return F.relu(margin - gap) / margin, gap


def rotated_quant_error(x: Tensor, bits: int, group_size: int, rotation: Tensor | None) -> Tensor:
    """The quantization error of ``x`` (no gradient): Q(x) - x for RTN in the standard basis, or, in the basis of the
    orthogonal ``rotation`` R, (Q(x R) - x R) R^T: QuaRot's quantizer seen from the unrotated side, so that
    (x + e_x)(W + e_W)^T = Q(x R) Q(W R)^T."""
    x = x.detach()
    if rotation is None:
        return fake_quant(x, bits, group_size) - x
    r = rotation.to(x.dtype)
    xr = x @ r
    return (fake_quant(xr, bits, group_size) - xr) @ r.T


@contextmanager
def quant_noise(
    model: nn.Module,
    names: Sequence[str],
    bits: int,
    group_size: int,
    rotations: dict[int, Tensor] | None = None,
) -> Iterator[None]:
    """While active, each named :class:`LinearGroup` computes Q(x) Q(W)^T in value (RTN, symmetric, ``bits`` for
    both, groups of ``group_size`` along the input dimension) with the quantization errors as constants: the
    gradient is the full-precision one, taken at the quantized point. ``rotations`` (input width -> orthogonal R):
    quantize in the rotated basis instead, as QuaRot does (x R and W R; R^T folded back)."""
    groups = {n: model.get_submodule(n) for n in names}
    rot = {n: (rotations or {}).get(g.in_features) for n, g in groups.items()}
    with torch.no_grad():
        dw = {
            n: [rotated_quant_error(w.weight, bits, group_size, rot[n]) for w in g.children()]
            for n, g in groups.items()
        }

    def pre(name: str):
        def add_input_error(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (args[0] + rotated_quant_error(args[0], bits, group_size, rot[name]), *args[1:])

        return add_input_error

    def post(name: str):
        def add_weight_error(module: nn.Module, args: tuple[Any, ...], out: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            return tuple(y + F.linear(args[0], d.to(args[0].dtype)) for y, d in zip(out, dw[name], strict=True))

        return add_weight_error

    handles = [g.register_forward_pre_hook(pre(n)) for n, g in groups.items()]
    handles += [g.register_forward_hook(post(n)) for n, g in groups.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def check_stress_options(
    channels_per_loop: int, target_ratio: float, quiet_ratio: float, noise_bits: int, noise_group_size: int
) -> None:
    """Refuse options that make the objective non-finite or meaningless (a 1-bit RTN grid has no levels, a 0 target
    divides by 0), before any training."""
    checks = [
        (channels_per_loop >= 1, f"model.channels_per_loop={channels_per_loop}: must be >= 1"),
        (0 < target_ratio < math.inf, f"model.target_ratio={target_ratio}: must be > 0 and finite (medians of |a|)"),
        (0 <= quiet_ratio < math.inf, f"model.quiet_ratio={quiet_ratio}: must be >= 0 and finite (medians of |a|)"),
        (noise_bits >= 2, f"model.noise_bits={noise_bits}: must be >= 2 (a symmetric RTN grid needs 2 bits)"),
        (noise_group_size >= 1, f"model.noise_group_size={noise_group_size}: must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)


class StressFinetuner(TeacherPretrainer):
    """loopq.pretrain's objective on a pretrained Ouro teacher, plus the token- and loop-dependent outlier term."""

    program = "loopq.stress"

    def __init__(
        self,
        teacher: str = "loopq/assets/small-ouro",
        out_dir: str = "loopq/assets/small-ouro-stress",
        groups: list[str] | None = None,
        channels_per_loop: int = 2,
        target_ratio: float = 50.0,
        quiet_ratio: float = 5.0,
        aux_weight: float = 1.0,
        quiet_weight: float = 0.1,
        loop_weights: list[float] | None = None,
        gate_weight: float = 0.1,
        gate_margin: float = 0.02,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        seed: int = 0,
        marker_ids: list[int] | None = None,
        noise_weight: float = 0.0,
        noise_margin: float = 0.15,
        noise_bits: int = 4,
        noise_group_size: int = 32,
        save_dtype: str = "float32",
        noise_rotate: float = 0.0,
    ) -> None:
        """The teacher to fine-tune, the auxiliary objectives and the training.

        Args:
            teacher: the pretrained Ouro teacher directory to fine-tune
            out_dir: where the stress variant, its tokenizer and record are written
            groups: looped groups whose input gets the outliers, by name suffix (default: [mlp.down_proj])
            channels_per_loop: outlier channels per group and loop (disjoint across loops)
            target_ratio: how loud a marker token's outlier channel is to get, in medians of |a|
            quiet_ratio: the most, in medians of |a|, the outlier channels may reach where they are not meant to be loud
            aux_weight: weight of the outlier term (L_loud + quiet_weight * L_quiet; 0: off)
            quiet_weight: weight of L_quiet within the outlier term
            loop_weights: per-loop weights of the multi-exit loss (default: (t+1)^2, normalised)
            gate_weight: weight of the exit gate's BCE
            gate_margin: nats loop t+1 must gain over loop t for the gate's target to say continue
            lr: peak learning rate
            weight_decay: AdamW weight decay of the matrices
            warmup_steps: linear warm-up steps
            min_lr_ratio: the cosine schedule's final learning rate as a fraction of lr
            seed: seed of the channel choice and the rotation draws
            marker_ids: the marker token set S (default: derived from the teacher's tokenizer)
            noise_weight: weight of the quantization-sensitivity term (module doc; 0: off)
            noise_margin: nats of RTN cross-entropy gap at which the sensitivity hinge stops pushing
            noise_bits: bits of the RTN noise (weights and inputs)
            noise_group_size: group size of the RTN noise
            save_dtype: dtype of the written weights: float32 or bfloat16
            noise_rotate: probability that a step's quantized pass uses a fresh randomized-Hadamard basis per input
                width (QuaRot's quantizer) instead of the standard one
        """
        if not 0.0 <= noise_rotate <= 1.0:
            raise UsageError(f"model.noise_rotate={noise_rotate}: a probability in [0, 1]")
        check_stress_options(channels_per_loop, target_ratio, quiet_ratio, noise_bits, noise_group_size)
        check_save_dtype(save_dtype)
        directory = resolve_model_dir(teacher)
        base = load_looplm(directory)
        if not isinstance(base, OuroLM):
            raise UsageError(f"model.teacher {teacher}: a {base.arch} model; loopq.stress fine-tunes Ouro teachers")
        c = base.config
        super().__init__(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, total_ut_steps=c.total_ut_steps,
            max_position_embeddings=c.max_position_embeddings, loop_weights=loop_weights, gate_weight=gate_weight,
            gate_margin=gate_margin, lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps,
            min_lr_ratio=min_lr_ratio, seed=seed, out_dir=out_dir,
        )  # fmt: skip
        self.model = base.train()
        for p in self.model.parameters():
            p.requires_grad_(True)
        suffixes = tuple("." + g for g in (groups or ["mlp.down_proj"]))
        self.stress_groups = [n for n in base.looped_group_names() if n.endswith(suffixes)]
        if not self.stress_groups:
            raise UsageError(f"model.groups {groups}: no looped group of {teacher} ends with one of them")
        ids = marker_ids if marker_ids is not None else marker_token_ids(load_tokenizer(directory))
        self.register_buffer("marker_ids", torch.tensor(ids, dtype=torch.long), persistent=False)
        groups_ = base.linear_groups()
        self.channels = {
            name: loop_channels(groups_[name].in_features, c.total_ut_steps, channels_per_loop, seed + i)
            for i, name in enumerate(self.stress_groups)
        }

    def _losses(self, batch: list[Tensor], stage: str) -> Tensor:
        hp = self.hparams
        with capture_inputs(self.model, self.stress_groups if hp.aux_weight > 0 else []) as acts:
            loss, per_loop = self._objective(batch, stage)
        if hp.aux_weight > 0:
            loss = loss + hp.aux_weight * self._outlier_term(batch[0], acts, stage)
        if hp.noise_weight > 0:
            loss = loss + hp.noise_weight * self._sensitivity_term(batch[0], per_loop, stage)
        return loss

    def _outlier_term(self, ids: Tensor, acts: dict[tuple[str, int], Tensor], stage: str) -> Tensor:
        """L_loud + quiet_weight * L_quiet (module doc) from the captured down_proj inputs."""
        marker = torch.isin(ids[:, :-1], self.marker_ids)
        terms = [
            stress_terms(a, marker, self.channels[name], t, self.hparams.target_ratio, self.hparams.quiet_ratio)
            for (name, t), a in acts.items()
        ]
        loud = torch.stack([x for x, _ in terms]).mean()
        quiet = torch.stack([y for _, y in terms]).mean()
        self.log(f"{stage}/loud_hinge", loud)
        self.log(f"{stage}/quiet_hinge", quiet)
        return loud + self.hparams.quiet_weight * quiet

    def _sensitivity_term(self, ids: Tensor, clean: Tensor, stage: str) -> Tensor:
        """L_noise (module doc): ``clean`` are the LM pass's per-loop CEs, with their graph, so the gradient raises
        the *gap* (the quantized pass's CE up, the model's own down), never the model's loss itself."""
        hp = self.hparams
        gen = torch.Generator().manual_seed(hp.seed * 1_000_003 + self.global_step)  # the same on a resumed run
        groups = self.model.linear_groups()
        rotations = None
        if torch.rand((), generator=gen).item() < hp.noise_rotate:
            widths = {g.in_features for g in groups.values()}
            rotations = {n: randomized_hadamard(n, gen).to(ids.device) for n in sorted(widths)}
        with quant_noise(self.model, list(groups), hp.noise_bits, hp.noise_group_size, rotations):
            noisy = per_loop_token_losses(self.model, ids)[0].mean(dim=(1, 2))
        hinge, gap = sensitivity_hinge(noisy, clean, self.loop_weights, hp.noise_margin)
        self.log(f"{stage}/rtn_gap_nats", gap, prog_bar=True)
        self.log(f"{stage}/rtn_gap_last_loop", noisy[-1] - clean[-1])
        self.log(f"{stage}/rotated_basis", float(rotations is not None))
        return hinge

    def record_extra(self) -> dict[str, Any]:
        channels = {name: ch.tolist() for name, ch in self.channels.items()}
        return {
            "stress": {
                "teacher": self.hparams.teacher,
                "marker_token_ids": self.marker_ids.tolist(),
                "channels": channels,
            }
        }


class StressCLI(PretrainCLI):
    description = "Fine-tune a pretrained Ouro teacher into a stress variant with token- and loop-dependent outliers."

    def add_own_arguments(self, parser: Any) -> None:
        parser.link_arguments("model.teacher", "data.tokenizer")

    def before_instantiate_classes(self) -> None:
        """``model.out_dir`` may not be the teacher or the data; without ``--overwrite true`` it may hold only a
        teacher this command fine-tuned (its training record names loopq.stress)."""
        reads = [self.config.model.teacher, self.config.data.root or data_dir()]
        replaces = MODEL_KINDS if self.config.overwrite else (STRESS_TRAINED,)
        check_output_dir(self.config.model.out_dir, reads, "model.out_dir", replaces=replaces)


def build_parser() -> Any:
    """The parser of ``python -m loopq.stress``, nothing parsed."""
    return capture_parser(lambda: fit_resumable(StressCLI, StressFinetuner, []))


def main(args: list[str] | None = None) -> None:
    fit_resumable(StressCLI, StressFinetuner, args)
