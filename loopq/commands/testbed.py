"""The embedded testbed: what the teacher's loops do, and how fragile it is under quantization.

    python -m loopq.testbed --model loopq/assets/tiny-ouro --outliers_out loopq/assets/tiny-ouro-outliers

measures, on WikiText-2 raw test (GPTQ protocol, 256-token windows): per-loop perplexity, the unigram
perplexity of the same tokenizer (estimated on the training text), the P99 |activation| of each looped layer's
inputs per loop (the paper's Figure-1 drift), and a fragility table - FP, RTN W4A8 / W4A4 g32 / W4A4 per-token /
W3A3 g32 - with perplexity and relative loop-state error per loop. With ``--outliers_out`` it also writes the
*stress* variant (see :func:`outlier_reparameterize`) and measures it the same way. The activation regime
(:mod:`loopq.calib.regime`: channel max/median ratios, kurtosis, where the largest activations sit, loop-to-loop rank
correlation of the channel profile, the sharing gap of every looped group) is measured on the first 8 windows.
``--windows N`` measures the perplexities on the first N windows only (for teachers too slow for all of them; the
record says how many). Results go to ``testbed.json`` + ``TESTBED.md`` in each model directory.

The stress variant mimics the massive-activation channels of real LLMs while computing the *same* function:
for every RMSNorm that feeds a quantized group (``norm_feeds`` of the architecture), ``channels`` fixed channels
(seeded, the same in every layer, as in real LLMs) of the norm weight are multiplied by ``factor`` and the same
input columns of the consuming linears are divided by it. ``factor`` is a power of two (32), so both scalings
are exact in binary floating point and the FP logits are bit-identical.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch
from jsonargparse.typing import PositiveInt
from tokenizers import Tokenizer
from torch import Tensor

from loopq.artifacts.layout import check_output_dir
from loopq.calib.regime import activation_regime, fresh_sharing_gaps, looped_group_inputs
from loopq.commands.cli import Command
from loopq.data.text import DEFAULT_TRAINING_SOURCES, read_training_text, resolve_sources
from loopq.data.tokenizer import load_tokenizer
from loopq.errors import UsageError
from loopq.files import atomic_write
from loopq.metrics.perplexity import perplexity, token_windows, wikitext2_stream
from loopq.models import LoopLM, load_looplm
from loopq.quant import QuantConfig, prepare

SEQ_LEN = 256
#: record entries too long to print
BULKY = ("activation_p99", "regime", "sharing_gap")
#: the first windows of WikiText-2 test that the tests re-measure against the record (a fast, exact check)
QUICK_WINDOWS = 48

#: the fragility table's rows: plain symmetric RTN (no transforms, no learned clipping, no LoopQ parts)
RTN_SETTINGS: dict[str, dict[str, int]] = {
    "RTN W4A8 g32": {"w_bits": 4, "a_bits": 8, "group_size": 32},
    "RTN W4A4 g32": {"w_bits": 4, "a_bits": 4, "group_size": 32},
    "RTN W4A4 per-token": {"w_bits": 4, "a_bits": 4, "group_size": -1},
    "RTN W3A3 g32": {"w_bits": 3, "a_bits": 3, "group_size": 32},
}


def outlier_reparameterize(model: LoopLM, channels: int, factor: float, seed: int) -> tuple[LoopLM, list[int]]:
    """A function-preserving copy of ``model`` with ``channels`` massive-activation channels (see module doc), and
    the channels chosen; ``model`` has ``norm_feeds`` (:func:`check_has_stress_variant`)."""
    dim = model.state_dim
    chosen = sorted(torch.randperm(dim, generator=torch.Generator().manual_seed(seed))[:channels].tolist())
    out = copy.deepcopy(model)
    idx = torch.tensor(chosen)
    with torch.no_grad():
        for layer in out.loop_layers:
            for norm_name, group_name in model.norm_feeds.items():
                layer.get_submodule(norm_name).weight[idx] *= factor
                for linear in layer.get_submodule(group_name).children():
                    linear.weight[:, idx] /= factor
    return out, chosen


def check_outlier_options(channels: int, factor: float, width: int | None = None) -> None:
    """Refuse, before any measurement, a stress variant that is not the function-preserving rescaling the module doc
    describes: ``factor`` must be a power of two (bit-identical rescaling; 0 wrote NaN weights) and ``channels``
    within 1..``width`` (the hidden size; 0 failed after the measurement)."""
    if not (math.isfinite(factor) and factor > 0 and math.frexp(factor)[0] == 0.5):
        raise UsageError(f"--factor {factor}: must be a positive power of two (e.g. 32), so the rescaling is exact")
    if channels < 1 or (width is not None and channels > width):
        limit = f"the hidden size {width}" if width is not None else "the hidden size"
        raise UsageError(f"--channels {channels}: must be between 1 and {limit}")


def check_has_stress_variant(model: LoopLM, model_dir: Path) -> None:
    """``--outliers_out`` needs an RMSNorm feeding a quantized group (``norm_feeds``): refused before any
    measurement or write otherwise (LoopFormer's groups are fed by weightless, time-modulated RMS norms)."""
    if not model.norm_feeds:
        raise UsageError(
            f"--outliers_out: {model_dir} ({model.arch}) has no RMSNorm feeding a quantized group (norm_feeds is "
            "empty), so it has no stress variant; drop --outliers_out"
        )


def unigram_perplexity(train_ids: Tensor, test_ids: Tensor, vocab_size: int) -> float:
    """Perplexity of an add-one-smoothed unigram model fitted on ``train_ids`` over ``test_ids``."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return math.exp(-float(logp[test_ids].mean()))


def activation_p99(model: LoopLM, windows: Tensor) -> dict[str, list[float]]:
    """P99 |x| of every looped group's input, per loop (the same physical layer seen by each loop)."""
    records = looped_group_inputs(model, windows)
    return {
        name: [float(torch.quantile(v[t].abs().flatten()[:1_000_000], 0.99)) for t in sorted(v)]
        for name, v in records.items()
    }


@torch.no_grad()
def state_errors(teacher: LoopLM, student: LoopLM, windows: Tensor) -> list[float]:
    """Relative l2 error ||H~_t - H_t|| / ||H_t|| of every loop state."""
    ref = teacher(windows, return_trajectory=True).loop_states
    got = student(windows, return_trajectory=True).loop_states
    return [float((g - r).norm() / r.norm()) for g, r in zip(got, ref, strict=True)]


def fragility(model: LoopLM, stream: Tensor, probe: Tensor) -> dict[str, dict[str, Any]]:
    """FP and plain RTN rows: last-loop ppl, per-loop ppl and per-loop relative state error."""
    rows: dict[str, dict[str, Any]] = {}
    fp = perplexity(model, stream, SEQ_LEN, batch_size=8, per_loop=True)
    rows["FP"] = {"ppl": fp.ppl, "per_loop_ppl": list(fp.per_loop), "state_error": [0.0] * len(fp.per_loop)}
    for name, setting in RTN_SETTINGS.items():
        student = prepare(model, QuantConfig.rtn(**setting)).eval()
        res = perplexity(student, stream, SEQ_LEN, batch_size=8, per_loop=True)
        rows[name] = {
            "ppl": res.ppl,
            "per_loop_ppl": list(res.per_loop),
            "state_error": state_errors(model, student, probe),
        }
    return rows


def training_token_ids(tokenizer: Tokenizer) -> Tensor:
    docs = read_training_text(resolve_sources(list(DEFAULT_TRAINING_SOURCES)))
    return torch.tensor([i for enc in tokenizer.encode_batch(docs) for i in enc.ids])


def measure(model_dir: Path, tokenizer: Tokenizer, model: LoopLM, windows: int | None = None) -> dict[str, Any]:
    stream = torch.tensor(wikitext2_stream(tokenizer))
    probe = token_windows(stream, SEQ_LEN)[:8]
    if windows is not None:
        stream = stream[: windows * SEQ_LEN]
    table = fragility(model, stream, probe)
    fp_loops = table["FP"]["per_loop_ppl"]
    subset = stream[: QUICK_WINDOWS * SEQ_LEN]
    quick_rtn = prepare(model, QuantConfig.rtn(4, 4, 32)).eval()
    return {
        "quick_check": {
            "windows": QUICK_WINDOWS,
            "fp_ppl": perplexity(model, subset, SEQ_LEN, batch_size=8).ppl,
            "rtn_w4a4_g32_ppl": perplexity(quick_rtn, subset, SEQ_LEN, batch_size=8).ppl,
        },
        "wikitext2_windows": int(stream.numel() // SEQ_LEN),
        "seq_len": SEQ_LEN,
        "unigram_ppl": unigram_perplexity(training_token_ids(tokenizer), stream, tokenizer.get_vocab_size()),
        "last_over_first_loop_ppl": fp_loops[-1] / fp_loops[0],
        "activation_p99": activation_p99(model, probe),
        "fragility": table,
        "regime": activation_regime(model, probe, tokenizer),
        "sharing_gap": fresh_sharing_gaps(str(model_dir), probe[:4]),
    }


def markdown(name: str, result: dict[str, Any], extra: str = "") -> str:
    lines = [
        f"# {name}: testbed record",
        "",
        extra,
        "",
        "Measured by `python -m loopq.testbed` (WikiText-2 raw test, "
        f"{result['wikitext2_windows']} windows x {result['seq_len']} tokens, GPTQ protocol).",
        "",
    ]
    lines += [f"- unigram perplexity (same tokenizer, fitted on the training text): {result['unigram_ppl']:.1f}"]
    lines += [f"- last-loop / loop-1 FP perplexity: {result['last_over_first_loop_ppl']:.3f}", ""]
    loops = len(result["fragility"]["FP"]["per_loop_ppl"])
    head = "| setting | ppl | " + " | ".join(f"ppl loop {t + 1}" for t in range(loops))
    head += " | " + " | ".join(f"err loop {t + 1}" for t in range(loops)) + " |"
    lines += [head, "|" + "---|" * (2 + 2 * loops)]
    for setting, row in result["fragility"].items():
        cells = (
            [f"{row['ppl']:.1f}"] + [f"{p:.1f}" for p in row["per_loop_ppl"]] + [f"{e:.3f}" for e in row["state_error"]]
        )
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    lines += ["", "P99 |input| of each looped group per loop (loop-dependent drift, paper Fig. 1):", ""]
    lines += ["| group | " + " | ".join(f"loop {t + 1}" for t in range(loops)) + " |", "|" + "---|" * (1 + loops)]
    for group, values in result["activation_p99"].items():
        lines.append(f"| {group} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    if "regime" in result:
        lines += regime_markdown(result["regime"], result.get("sharing_gap", {}), loops)
    return "\n".join(lines) + "\n"


def regime_markdown(regime: dict[str, Any], gaps: dict[str, float], loops: int) -> list[str]:
    """The activation-regime tables (see :mod:`loopq.calib.regime`)."""
    s = regime["summary"]
    lines = [
        "",
        "## Activation regime (first 8 windows; `loopq.calib.regime`)",
        "",
        f"- channel max/median ratio: median {s['max_median_ratio_median']:.1f}, max {s['max_median_ratio_max']:.1f} "
        f"(over {s['groups']} looped groups x {loops} loops)",
        f"- kurtosis of the group inputs: median {s['kurtosis_median']:.1f}, max {s['kurtosis_max']:.1f} (Gaussian: 3)",
        f"- rank correlation of the channel profile, loop 1 vs loop {loops}: median "
        f"{s['rank_corr_first_last_median']:.3f}, min {s['rank_corr_first_last_min']:.3f}; overlap of the top K/32 "
        f"channels (Jaccard), median {s['top_channel_overlap_first_last_median']:.2f}",
        f"- top-1% activations at position 0 (median over groups): {s['top_at_position_0_median']:.2f}",
        "",
        "| group | max/median per loop | kurtosis per loop | rank corr t->t+1 | rank corr 1->T "
        "| top-ch. overlap 1->T | top-1% at pos 0 / special / punct. | most frequent top tokens | S_l (fresh) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, g in regime["groups"].items():
        sites = g["top_sites"]
        common = ", ".join(f"`{tok!r}` {n}" for tok, n in sites["most_frequent"][:3])
        lines.append(
            f"| {name} | {' / '.join(f'{v:.1f}' for v in g['max_median_ratio'])} | "
            f"{' / '.join(f'{v:.1f}' for v in g['kurtosis'])} | "
            f"{' / '.join(f'{v:.2f}' for v in g['rank_corr_consecutive'])} | {g['rank_corr_first_last']:.2f} | "
            f"{g['top_channel_overlap_first_last']:.2f} | "
            f"{sites['at_position_0']:.2f} / {sites['at_special']:.2f} / {sites['at_punctuation']:.2f} | {common} | "
            f"{gaps.get(name, float('nan')):.3g} |"
        )
    return lines


def write(model_dir: Path, name: str, result: dict[str, Any], extra: str = "") -> None:
    """``testbed.json`` and ``TESTBED.md`` in ``model_dir``; the record printed without its :data:`BULKY` entries."""
    text = json.dumps(result, indent=2) + "\n"
    atomic_write(model_dir / "testbed.json", lambda p: p.write_text(text))
    atomic_write(model_dir / "TESTBED.md", lambda p: p.write_text(markdown(name, result, extra)))
    print(json.dumps({k: v for k, v in result.items() if k not in BULKY}, indent=1))


def testbed(
    model: Path,
    outliers_out: Path | None = None,
    channels: int = 4,
    factor: float = 32.0,
    seed: int = 0,
    windows: PositiveInt | None = None,
) -> None:
    """Measure ``model`` (and with ``outliers_out`` its stress variant) and write the records.

    Args:
        model: model directory (config.json, weights, tokenizer.json)
        outliers_out: also write and measure the stress variant here
        channels: the stress variant's massive-activation channels
        factor: the power of two those channels are scaled by
        seed: seed of the choice of channels
        windows: perplexities on the first N windows only (default: all)
    """
    if outliers_out:  # only an earlier stress variant may be replaced, never the teacher or another model
        check_outlier_options(channels, factor)
        check_output_dir(outliers_out, [model], "--outliers_out", replaces=("stress variant",))
    tokenizer = load_tokenizer(model)
    teacher = load_looplm(model)
    if outliers_out:
        check_has_stress_variant(teacher, model)
        check_outlier_options(channels, factor, teacher.state_dim)
    result = measure(model, tokenizer, teacher, windows)
    write(model, model.name, result)
    if outliers_out:
        stressed, chosen = outlier_reparameterize(teacher, channels, factor, seed)
        outliers = {"channels": chosen, "factor": factor, "seed": seed}
        # the record first: a run stopped while measuring leaves a folder a re-run recognises as its own
        atomic_write(outliers_out / "testbed.json", lambda p: p.write_text(json.dumps({"outliers": outliers})))
        stressed.save_pretrained(outliers_out)
        atomic_write(outliers_out / "tokenizer.json", lambda p: tokenizer.save(str(p)))
        note = (
            f"Stress variant of `{model}`: channels {chosen} of every RMSNorm in `norm_feeds` "
            f"multiplied by {factor:g}, the consuming input columns divided by it (seed {seed}; "
            f"`python -m loopq.testbed --model {model} --outliers_out {outliers_out}`)."
        )
        res = measure(outliers_out, tokenizer, stressed, windows)
        res["outliers"] = outliers
        write(outliers_out, outliers_out.name, res, note)


COMMAND = Command(testbed, "loopq.testbed", __doc__, renames={"--outliers-out": "--outliers_out"})

build_parser, main = COMMAND.parser, COMMAND.run
