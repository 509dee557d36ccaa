"""Evaluate one model - FP teacher, a training-free baseline, a calibrated fake-quant student, or an exported int
model - on the paper's metrics, and write a results JSON:

    python -m loopq.evaluate --model loopq/assets/tiny-ouro --method FP --out results/fp.json
    python -m loopq.evaluate --model loopq/assets/tiny-ouro --method RTN --bits w4a4 --out results/rtn.json
    python -m loopq.evaluate --model loopq/assets/tiny-ouro --method QuaRot --bits w4a4 --out results/quarot.json
    python -m loopq.evaluate --student runs/tiny/student --method LoopQ --out results/loopq.json
    python -m loopq.evaluate --exported runs/tiny/exported --method LoopQ-int --out results/int.json

Numbers: WikiText-2 perplexity under the standard PTQ protocol (GPTQ windows of ``ppl_seq_len`` tokens, per loop
as well; ``--ppl_windows`` keeps only the first N windows) and, unless ``--tasks '[]'``, the lm-eval tasks
(default: the ``loopq_paper`` group; ``--limit`` caps the examples per task - the sizes are recorded in the JSON).

With ``--model``, ``--method`` Symmetric (or RTN...), SmoothQuant or QuaRot builds that training-free baseline from
the teacher (:data:`STATIC_METHODS`, :func:`loopq.quant.prepare.prepare_static`) on ``calib_samples`` windows of
``calib_seq_len`` tokens of the calibration text (drawn as ``python -m loopq.fit`` draws them); other labels evaluate
the teacher itself (FP), except the trained methods' names: SpinQuant, FlatQuant and LoopQ are ``--student``s.

``--device`` (default ``auto``: cuda when available, :mod:`loopq.devices`) is where the model is evaluated; the JSON
records it. A training-free baseline is calibrated on that device too.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jsonargparse.typing import PositiveInt

from loopq.artifacts import load_artifact, read_artifact_meta, tokenizer_dir
from loopq.commands.cli import Command
from loopq.data.calibration import calibration_samples
from loopq.data.text import DEFAULT_CALIBRATION_SOURCES, check_sources_listed
from loopq.data.tokenizer import load_tokenizer
from loopq.devices import AUTO, resolve_device
from loopq.errors import UsageError
from loopq.files import atomic_write
from loopq.locks import file_lock
from loopq.metrics.perplexity import PerplexityResult, lambada_stream, perplexity, wikitext2_stream
from loopq.models import LoopLM
from loopq.models.loading import resolve_model_dir
from loopq.planning.guards import check_output_file, check_positions
from loopq.provenance import record, teacher_fingerprint
from loopq.quant import QuantConfig
from loopq.quant.config import FP_LABEL, METHODS, Bits, method_of_label
from loopq.quant.prepare import prepare_static

#: the ``--method`` labels of a ``--model`` (case does not matter): FP, or a training-free baseline built from it
MODEL_METHODS = (FP_LABEL, *(m.label for m in METHODS.values() if not m.trained), "RTN")


def static_method(label: str) -> str | None:
    """The training-free ``quant.method`` a ``--method`` label names (``RTN...`` labels are RTN), else None."""
    method = method_of_label(label)
    return method if method is not None and not METHODS[method].trained else None


@dataclass(frozen=True)
class ModelMethod:
    """``--method`` (and ``--bits``) of a ``--model``, parsed once: the FP teacher (``baseline`` None) or a
    training-free baseline (its ``quant.method``) at ``bits``."""

    baseline: str | None = None
    bits: Bits | None = None


#: the FP teacher as is
FP = ModelMethod()


def parse_model_method(method: str, bits: str) -> ModelMethod:
    """What ``--method`` / ``--bits`` ask of a ``--model``: FP, or a training-free baseline built from it. A trained
    method, or any other label (it would report the teacher's numbers under that label: a typo such as
    ``QuaRott``), is refused; ``--bits`` is read only for a baseline."""
    key = method.lower()
    if key in METHODS and METHODS[key].trained:
        raise UsageError(f"--method {method} is calibrated by python -m loopq.fit; evaluate its --student directory")
    baseline = static_method(method)
    if baseline is None and key != "fp":
        raise UsageError(
            f"--method {method!r} is not a method for --model; use {MODEL_METHODS} (RTN... labels are RTN), or "
            "evaluate a calibrated --student / --exported model under any label"
        )
    return FP if baseline is None else ModelMethod(baseline, Bits.parse(bits, "--bits"))


def static_config(method: str, bits: Bits, group_size: int = 32) -> QuantConfig:
    """The config of a training-free baseline at ``bits``."""
    return QuantConfig.of_method(method, bits.w, bits.a, group_size=group_size)


def check_options(
    model: str | None, student: str | None, exported: str | None, method: str, bits: str, tasks: list[str]
) -> ModelMethod:
    """Every option that can be checked without loading a model, checked before anything is loaded; what a
    ``--model`` is evaluated as (:data:`FP` for a student or export, whose bits are its own)."""
    if [model, student, exported].count(None) != 2:
        raise UsageError("pass exactly one of --model (FP or a training-free baseline), --student or --exported")
    choice = parse_model_method(method, bits) if model is not None else FP
    if tasks:
        from loopq.metrics.tasks import check_tasks

        check_tasks(tasks)
    return choice


def build(
    model: str | None,
    student: str | None,
    exported: str | None,
    choice: ModelMethod = FP,
    calib_samples: int = 32,
    calib_seq_len: int = 128,
    teacher: str | None = None,
    device: torch.device | None = None,
    ppl_seq_len: int | None = None,
    calib_sources: list[str] | None = None,
) -> tuple[LoopLM, str, str]:
    """The model to evaluate on ``device`` (default: the CPU), the directory its tokenizer lives in, and its actual
    bit widths. A baseline calibrates on ``calib_samples`` windows of ``calib_seq_len`` tokens of ``calib_sources``
    (``data.sources`` of a fit config; None: its default). ``ppl_seq_len`` (and a baseline's ``calib_seq_len``) are
    checked against the model's positions as soon as it is loaded, before a baseline is calibrated."""
    device = device or torch.device("cpu")
    if student or exported:
        path = student or exported
        artifact = load_artifact(path, kind="student" if student else "export", teacher=teacher, device=device)
        check_lengths(artifact.model, {"--ppl_seq_len": ppl_seq_len})
        return artifact.model, str(tokenizer_dir(path, artifact)), artifact.bits
    if model is None:
        raise UsageError("pass --model (FP or a training-free baseline), --student or --exported")
    fp = load_artifact(model, kind="teacher", device=device)
    teacher, model_dir = fp.model, fp.meta["teacher"]
    baseline = choice.baseline
    check_lengths(teacher, {"--ppl_seq_len": ppl_seq_len, "--calib_seq_len": calib_seq_len if baseline else None})
    if baseline is None or choice.bits is None:
        return teacher, model_dir, "fp"
    ids = calibration_samples(model_dir, calib_samples, calib_seq_len, sources=calib_sources).to(device)
    return prepare_static(teacher, static_config(baseline, choice.bits), ids), model_dir, choice.bits.label


def check_lengths(net: LoopLM, lengths: dict[str, int | None]) -> None:
    """Each sequence-length option given (not None) fits the positions of ``net``."""
    for key, length in lengths.items():
        if length is not None:
            check_positions(net, length, key)


def evaluate(
    model: str | None = None,
    student: str | None = None,
    exported: str | None = None,
    method: str = "FP",
    bits: str = "w4a4",
    tasks: list[str] | None = None,
    limit: int | None = None,
    num_loops: int | None = None,
    ppl_seq_len: int = 256,
    ppl_windows: PositiveInt | None = None,
    lambada_ppl: bool = False,
    batch_size: int = 8,
    out: str | None = None,
    variant: str | None = None,
    calib_samples: int = 32,
    calib_seq_len: int = 128,
    calib_sources: list[str] | None = None,
    teacher: str | None = None,
    device: str = AUTO,
) -> dict[str, Any]:
    """Evaluate and return (and with ``out``, write) ``{"method", "bits", "wikitext2_ppl", "per_loop", "lm_eval"}``.
    The JSON records the provenance: the teacher's content hash, and a student's or export's calibration config.

    Args:
        model: FP teacher directory (or hub id): evaluated as FP or as a training-free baseline (--method)
        student: calibrated fake-quant student directory (python -m loopq.fit)
        exported: exported int model directory (python -m loopq.export)
        method: the label recorded; for --model, FP or a training-free baseline (Symmetric, RTN..., SmoothQuant,
            QuaRot)
        bits: a training-free baseline's bit widths (w4a4, w4a8)
        tasks: lm-eval tasks (default: the loopq_paper group; [] or none given: perplexity only)
        limit: lm-eval examples per task (default: all)
        num_loops: loops to evaluate at (default: the model's)
        ppl_seq_len: WikiText-2 window length (tokens)
        ppl_windows: the first N perplexity windows only, of WikiText-2 (and LAMBADA) (default: all)
        lambada_ppl: also the perplexity of the LAMBADA test passages as running text, same windows (a second
            corpus no calibration reads; ``lambada_ppl`` in the JSON)
        batch_size: evaluation batch size
        out: the results JSON to write
        variant: the model name the report groups by (default: the teacher directory's name)
        calib_samples: calibration windows of a training-free baseline
        calib_seq_len: tokens per calibration window of a training-free baseline
        calib_sources: calibration text of a training-free baseline, as a fit config's data.sources (files or globs
            relative to the data folder, or hf: specs; default: calibration/*.txt; [] is refused)
        teacher: teacher directory of a student whose recorded teacher path is gone (same content hash)
        device: auto (cuda when available), cpu, cuda or cuda:N
    """
    where = resolve_device(device)
    task_list = ["loopq_paper"] if tasks is None else tasks
    choice = check_options(model, student, exported, method, bits, task_list)
    check_sources_listed(calib_sources, DEFAULT_CALIBRATION_SOURCES, key="--calib_sources")
    if out:  # before any work: a result never replaces a model file or anything but an earlier result
        check_output_file(out, [model, student, exported])
    with file_lock(out, "loopq.evaluate") if out else nullcontext():  # a second evaluate --out of it refuses
        start = time.time()
        net, tok_dir, bits = build(
            model, student, exported, choice, calib_samples, calib_seq_len, teacher, where, ppl_seq_len, calib_sources
        )
        tokenizer = load_tokenizer(tok_dir)
        second = lambada_stream(tokenizer) if lambada_ppl else None  # a missing file is said before any work
        ppl = first_windows(net, wikitext2_stream(tokenizer), ppl_seq_len, ppl_windows, batch_size, num_loops)
        result: dict[str, Any] = {
            "method": method,
            "bits": bits,
            "model": model or student or exported,
            "variant": variant or model_name(tok_dir, exported),
            "num_loops": num_loops or net.default_num_loops,
            "wikitext2_ppl": ppl.ppl,
            "wikitext2_per_loop_ppl": list(ppl.per_loop or []),
            "wikitext2_windows": ppl.num_windows,
            "device": device_label(where),
            "provenance": provenance_of(model, student, exported),
        }
        if second is not None:
            lambada = first_windows(net, second, ppl_seq_len, ppl_windows, batch_size, num_loops, per_loop=False)
            result["lambada_ppl"], result["lambada_windows"] = lambada.ppl, lambada.num_windows
        if choice.baseline not in (None, "rtn"):
            result["calibration"] = {"samples": calib_samples, "seq_len": calib_seq_len}
            if calib_sources is not None:  # else the default sources (the JSON as before the option existed)
                result["calibration"]["sources"] = list(calib_sources)
        if task_list:
            result["lm_eval"] = run_lm_eval(net, tokenizer, task_list, limit, num_loops, batch_size)
        result["seconds"] = round(time.time() - start, 1)
        if out:
            atomic_write(Path(out), lambda p: p.write_text(json.dumps(result, indent=2) + "\n"))
    return result


def model_name(tok_dir: str, exported: str | None) -> str:
    """The teacher directory's name, which the report groups by: a teacher's or student's tokenizer directory is
    the teacher's; an export carries its own tokenizer, so its recorded teacher is named (the export directory's
    name made its results a model of their own in the report)."""
    teacher = read_artifact_meta(exported, kind="export")[0].get("teacher") if exported else None
    return Path(str(teacher or tok_dir).rstrip("/")).name


def first_windows(
    net: LoopLM,
    ids: list[int],
    seq_len: int,
    windows: int | None,
    batch_size: int,
    num_loops: int | None,
    per_loop: bool = True,
) -> PerplexityResult:
    """Perplexity (and each loop's) of the first ``windows`` ``seq_len``-token windows of ``ids`` (all if None)."""
    stream = torch.tensor(ids, device="cpu")  # host tokens; windows move per batch
    stream = stream if windows is None else stream[: windows * seq_len]
    return perplexity(net, stream, seq_len, batch_size, num_loops, per_loop=per_loop)


def device_label(device: torch.device) -> str:
    """``cpu``, or ``cuda (NVIDIA H100 80GB HBM3)``: where a result was computed, for its JSON."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def provenance_of(model: str | None, student: str | None, exported: str | None) -> dict[str, Any] | None:
    """What the evaluated model was made from: a teacher's content hash, or the student's / export's record."""
    if student or exported:
        return read_artifact_meta(student or exported, kind="student" if student else "export")[0].get("provenance")
    return record(teacher_fingerprint(resolve_model_dir(model))) if model else None


def run_lm_eval(
    net: LoopLM, tokenizer: Any, tasks: list[str], limit: int | None, num_loops: int | None, batch_size: int
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` on the in-memory model with LoopQ's offline tasks."""
    from lm_eval import simple_evaluate

    from loopq.metrics.lm import LoopQLM
    from loopq.metrics.tasks import paper_metrics, task_manager

    lm = LoopQLM.from_model(net, tokenizer, num_loops=num_loops, batch_size=batch_size)
    # bootstrap_iters=0: no bootstrapped stderr (not recorded here; 100k resamples per metric cost minutes on full sets)
    res = simple_evaluate(
        model=lm, tasks=tasks, limit=limit, task_manager=task_manager(), log_samples=False, bootstrap_iters=0
    )
    sizes = {name: n.get("effective", n.get("original")) for name, n in res.get("n-samples", {}).items()}
    return {"paper_metrics": paper_metrics(res["results"]), "limit": limit, "n_samples": sizes}


COMMAND = Command(evaluate, "loopq.evaluate", __doc__)

build_parser = COMMAND.parser


def main(argv: list[str] | None = None) -> None:
    result = COMMAND.run(argv)
    print(json.dumps({k: v for k, v in result.items() if k != "lm_eval"}, indent=1))
    if "lm_eval" in result:
        print(json.dumps(result["lm_eval"]["paper_metrics"], indent=1))
