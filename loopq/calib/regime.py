"""The activation regime of a looped teacher: how hard W4A4 is for it and how much its loops differ.

Measured on the inputs of every looped linear group, per loop (the same physical layer seen by each loop):

* the channel profile ``a_k = max_tokens |x_k|`` and its **max/median ratio** (a few massive channels make a
  per-group scale waste most of the 4-bit grid on them), and the **kurtosis** of the activation values
  (Gaussian: 3; outlier-heavy: tens to thousands);
* **where the largest activations sit**: of the tokens whose max |x| is in the top 1 %, the fraction at position 0
  (the attention sink of a window), at BOS/EOS tokens, and at punctuation/whitespace tokens, plus the most frequent
  such tokens;
* **how much the profile changes between loops**: the Spearman rank correlation of ``a`` between consecutive loops
  and between the first and the last loop (the whole profile's order), and the overlap of the top channels
  (the largest ``K/32``; Jaccard index) between the first and the last loop (1: the same massive channels in
  every loop, so one static rescaling could serve all loops; low: loop-dependent outliers, LAS/SLT territory);
* the **sharing gap** S_l of every looped group for a fresh LoopQ student (:func:`loopq.calib.slt.sharing_gap_scores`).

``python -m loopq.testbed`` records all of it in ``testbed.json`` / ``TESTBED.md``.
"""

from __future__ import annotations

import string
from collections import Counter
from itertools import pairwise
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import Tensor

from loopq.models import LoopLM

TOP_FRACTION = 0.01  # "largest activations": tokens whose max |x| is in the top 1 %
PUNCTUATION = set(string.punctuation) | {"Ġ", "Ċ", " ", "\n", "\t"}


def channel_absmax(x: Tensor) -> Tensor:
    """``a_k = max |x[..., k]|`` over every token: the channel profile ``[K]``."""
    return x.abs().reshape(-1, x.shape[-1]).amax(dim=0)


def max_median_ratio(profile: Tensor) -> float:
    """max / median of a channel profile (1: flat; >> 1: a few massive channels)."""
    return float(profile.max() / profile.median().clamp_min(1e-12))


def kurtosis(x: Tensor) -> float:
    """Pearson kurtosis E[(x - mu)^4] / sigma^4 of all values (3 for a Gaussian)."""
    v = x.double().flatten()
    centred = v - v.mean()
    var = centred.pow(2).mean()
    return float(centred.pow(4).mean() / var.pow(2).clamp_min(1e-300))


def ranks(v: Tensor) -> Tensor:
    """0-based ranks of ``v`` (ties broken by position: activation profiles are continuous)."""
    out = torch.empty_like(v, dtype=torch.float64)
    out[v.argsort()] = torch.arange(v.numel(), dtype=torch.float64)
    return out


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation of two profiles: the Pearson correlation of their ranks."""
    ra, rb = ranks(a.flatten()), ranks(b.flatten())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-300))


def top_channel_overlap(a: Tensor, b: Tensor, k: int | None = None) -> float:
    """Jaccard index of the ``k`` largest channels of two profiles (default ``max(1, K // 32)``)."""
    k = k or max(1, a.numel() // 32)
    top_a, top_b = set(a.topk(k).indices.tolist()), set(b.topk(k).indices.tolist())
    return len(top_a & top_b) / len(top_a | top_b)


def is_punctuation(token: str) -> bool:
    """A token made only of punctuation / whitespace (byte-level BPE spells a space ``Ġ`` and a newline ``Ċ``)."""
    return bool(token) and all(ch in PUNCTUATION for ch in token)


def top_token_sites(x: Tensor, ids: Tensor, tokenizer: Tokenizer, special: set[int]) -> dict[str, Any]:
    """Where the largest activations sit: of the tokens whose max |x| over channels is in the top
    :data:`TOP_FRACTION` (``x`` ``[B, S, K]``, ``ids`` ``[B, S]``), the fractions at position 0, at special
    (BOS/EOS) ids and at punctuation/whitespace tokens, and the five most frequent tokens."""
    token_max = x.abs().amax(dim=-1)  # [B, S]
    count = max(1, round(TOP_FRACTION * token_max.numel()))
    top = token_max.flatten().topk(count).indices
    positions = top % ids.shape[1]
    top_ids = ids.flatten()[top].tolist()
    names = [tokenizer.id_to_token(i) or str(i) for i in top_ids]
    return {
        "tokens": count,
        "at_position_0": float((positions == 0).double().mean()),
        "at_special": sum(i in special for i in top_ids) / count,
        "at_punctuation": sum(is_punctuation(n) for n in names) / count,
        "most_frequent": [[name, n] for name, n in Counter(names).most_common(5)],
    }


@torch.no_grad()
def looped_group_inputs(model: LoopLM, windows: Tensor) -> dict[str, dict[int, Tensor]]:
    """The input ``[B, S, K]`` of every looped linear group at every loop t, from one forward pass."""
    records: dict[str, dict[int, Tensor]] = {}
    looped = set(model.looped_group_names())
    handles = []
    for name, group in model.linear_groups().items():
        if name in looped:

            def hook(module: Any, args: tuple, name: str = name) -> None:
                records.setdefault(name, {})[args[1]] = args[0].detach().float().clone()

            handles.append(group.register_forward_pre_hook(hook))
    try:
        model(windows)
    finally:
        for h in handles:
            h.remove()
    return records


def activation_regime(model: LoopLM, windows: Tensor, tokenizer: Tokenizer) -> dict[str, Any]:
    """Per looped group: per-loop max/median ratio, kurtosis and absmax, the loop-to-loop rank correlation of the
    channel profile, and where the largest activations sit (over all loops); plus their summary over groups."""
    special = {i for i in (tokenizer.token_to_id("<|endoftext|>"), 0) if i is not None}
    groups: dict[str, Any] = {}
    for name, per_loop in looped_group_inputs(model, windows).items():
        loops = [per_loop[t] for t in sorted(per_loop)]
        profiles = [channel_absmax(x) for x in loops]
        groups[name] = {
            "max_median_ratio": [max_median_ratio(p) for p in profiles],
            "kurtosis": [kurtosis(x) for x in loops],
            "absmax": [float(p.max()) for p in profiles],
            "rank_corr_consecutive": [spearman(a, b) for a, b in pairwise(profiles)],
            "rank_corr_first_last": spearman(profiles[0], profiles[-1]),
            "top_channel_overlap_first_last": top_channel_overlap(profiles[0], profiles[-1]),
            "top_sites": top_token_sites(torch.cat(loops), windows.repeat(len(loops), 1), tokenizer, special),
        }
    return {"groups": groups, "summary": summarise(groups)}


def summarise(groups: dict[str, Any]) -> dict[str, float]:
    """Medians and extremes over groups of the per-group numbers (one line each in the record)."""

    def med(values: list[float]) -> float:
        return float(torch.tensor(values).median())

    ratios = [r for g in groups.values() for r in g["max_median_ratio"]]
    kurt = [k for g in groups.values() for k in g["kurtosis"]]
    corr = [g["rank_corr_first_last"] for g in groups.values()]
    overlap = [g["top_channel_overlap_first_last"] for g in groups.values()]
    pos0 = [g["top_sites"]["at_position_0"] for g in groups.values()]
    return {
        "groups": len(groups),
        "max_median_ratio_median": med(ratios),
        "max_median_ratio_max": max(ratios),
        "kurtosis_median": med(kurt),
        "kurtosis_max": max(kurt),
        "rank_corr_first_last_median": med(corr),
        "rank_corr_first_last_min": min(corr),
        "top_channel_overlap_first_last_median": med(overlap),
        "top_at_position_0_median": med(pos0),
    }


def fresh_sharing_gaps(model_dir: str, windows: Tensor, topk: int = 64) -> dict[str, float]:
    """S_l of every looped group for a fresh W4A4 LoopQ student of the teacher in ``model_dir`` (identity-started
    transforms; the paper's selection statistic before any calibration), on ``windows`` as one batch."""
    from loopq.calib.module import LoopQCalibration
    from loopq.calib.slt import sharing_gap_scores
    from loopq.calib.targets import compute_targets

    module = LoopQCalibration(model_dir, topk=topk)
    module.targets = compute_targets(module.teacher, windows, topk, module.num_loops)
    return sharing_gap_scores(module, [[torch.arange(windows.shape[0]), windows]])
