"""Converting a calibrated student to packed W4A4 / W4A8, writing the export directory and loading it back.

:func:`convert` swaps every fake-quant group of a student for a :class:`~loopq.quant.packed.PackedLinearGroup`
(weights folded in float64 and packed int4, activation side kept: P1, P2, 1/d and per-loop clips).
:func:`export_student` writes a self-contained directory (names in :mod:`loopq.artifacts.layout`):

* ``model.safetensors`` (:data:`EXPORT_WEIGHTS`) - every tensor of the quantized model under its module name: the
  teacher's FP tensors unchanged (embeddings, norms, heads, Ouro's exit gate, LoopFormer's adaLN/time embedders,
  Parcae's injection and value embeddings), each group's packed state (``<group>.weight`` uint8 ``[S_w, N, K/2]``,
  ``.weight_scale`` fp16 ``[S_w, N, K/32]``, ``.left``/``.right`` fp32 ``[S_t, n, n]``, ``.inv_d`` ``[S_t, K]``,
  ``.act_clip`` ``[S_a]``, ``.bias``) and the CTA adapters ``transition.{a,b,eta,u,v}``. Tied tensors are stored
  once; no pickle;
* ``loopq_export.json`` (:data:`EXPORT_META`) - format version, arch, QuantConfig, each group's layout (slots,
  shapes), promoted groups, calibrated loops, the CTA layout, the student's provenance (teacher content hash,
  calibration config), the size and sha256 of every other file (``files``) and ``meta_sha256``, a digest of
  everything else in the file (:mod:`loopq.artifacts.seal`): a hand-edited description (say a group's ``a_bits``)
  would run with other bits than it is labelled with, and flipped or swapped-in weights would print garbage or
  another model's numbers under this one's provenance, so :func:`load_quantized` refuses both;
* the teacher's ``config.json`` and tokenizer files.

The description is written last: a directory whose export was interrupted has no (or the previous) description,
whose manifest then does not match, and is refused on load. A sealed write journal
(:mod:`loopq.artifacts.ownership`) lists the files while they are written, so the rerun of an interrupted export
recognises them as its own.

:func:`load_quantized` follows gpt-fast: build the architecture from ``config.json`` on the meta device, swap the
listed groups for packed ones, install the adapters, then ``load_state_dict(assign=True)``.
"""

from __future__ import annotations

import copy
import json
import shutil
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from loopq.artifacts.layout import (
    EXPORT_FORMAT,
    EXPORT_META,
    EXPORT_WEIGHTS,
    MODEL_CONFIG,
    TOKENIZER_FILES,
    check_output_dir,
    check_owned,
)
from loopq.artifacts.ownership import begin, finish, journal_files, listed_files
from loopq.artifacts.seal import FILES, check_quant_agrees, manifest, seal, unseal, verify_file
from loopq.artifacts.student import check_exportable
from loopq.files import StagedFiles, read_json, read_safetensors, staged_files
from loopq.kernels import GROUP_SIZE
from loopq.models.base import LoopLM
from loopq.models.loading import architecture_for, read_config, resolve_model_dir
from loopq.quant.accounting import packed_groups
from loopq.quant.config import QuantConfig
from loopq.quant.cta import TransitionAdapters
from loopq.quant.packed import ExportError, PackedGroupSpec, PackedLinearGroup, fold_feeding_norms
from loopq.quant.prepare import quant_groups

REEXPORT = "export it again with python -m loopq.export"

__all__ = ["ExportError", "convert", "export_student", "load_quantized", "read_export_meta", "tied_aliases"]


# ---------------------------------------------------------------------------------------------------- convert
def convert(student: LoopLM) -> LoopLM:
    """A packed, inference-only copy of ``student`` (which is left untouched; FP tensors are shared, not copied)."""
    groups = quant_groups(student)
    if not groups:
        raise ExportError("the model has no fake-quant groups: build the student with loopq.quant.prepare first")
    own = {id(t) for m in [*groups.values(), student.transition] if m is not None for t in m.parameters()}
    memo = {id(t): t for t in chain(student.parameters(), student.buffers()) if id(t) not in own}
    model = copy.deepcopy(student, memo)
    for name, group in groups.items():
        model.set_submodule(name, PackedLinearGroup.from_quant_group(group, name))
    return model.requires_grad_(False).eval()


def export_student(student: LoopLM, meta: dict[str, Any], out_dir: str | Path) -> Path:
    """Convert ``student`` and write the export directory.

    ``meta`` is the student's description (:func:`loopq.artifacts.student.load_student`); only its
    ``teacher`` entry is read (where config.json and the tokenizer come from) - the rest is taken from the student.
    ``out_dir`` may be new or an earlier export, never the teacher's directory or another model's
    (:func:`loopq.artifacts.layout.check_output_dir`).
    """
    check_exportable(meta)
    out = check_export_dir(out_dir, meta.get("teacher"))
    model = convert(student)
    state = _unaliased_state(model)
    begin(out, "export", export_names(meta.get("teacher")))
    with staged_files(out) as files:  # an earlier export stays whole until every new file is written
        weights = files.write(EXPORT_WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": EXPORT_FORMAT}))
        written = {EXPORT_WEIGHTS: weights, **_copy_teacher_files(student, meta.get("teacher"), files)}
        description = export_meta(model, meta.get("teacher"), meta.get("provenance"), manifest(out, written))
        files.write(EXPORT_META, lambda p: p.write_text(json.dumps(description, indent=2) + "\n"))
    finish(out)
    return out


def check_export_dir(out_dir: str | Path, teacher: str | None, reads: tuple[Any, ...] = (), key: str = "--out") -> Path:
    """``out_dir`` is new, empty, an earlier export or this command's interrupted one
    (:func:`~loopq.artifacts.layout.check_output_dir`), and of the files an export writes, only those the earlier
    export's sealed manifest or the interrupted export's journal lists are there to be replaced."""
    out = check_output_dir(out_dir, [teacher, *reads], key, replaces=("export",))
    owned = [*listed_files(out / EXPORT_META, EXPORT_FORMAT), *journal_files(out, "export")]
    check_owned(out, export_names(teacher), owned, key)
    return out


def export_names(teacher: str | None) -> list[str]:
    """Every file an export of a student of ``teacher`` writes."""
    return [EXPORT_WEIGHTS, EXPORT_META, *export_files(teacher)]


def export_meta(
    model: LoopLM,
    teacher: str | None = None,
    provenance: dict[str, Any] | None = None,
    files: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON description of a converted model: everything :func:`load_quantized` needs besides the tensors and
    the ``files`` manifest (:func:`loopq.artifacts.seal.manifest`), sealed by ``meta_sha256`` (module docstring)."""
    groups = dict(packed_groups(model))
    described = {
        "format": EXPORT_FORMAT,
        "arch": model.arch,
        "teacher": teacher,
        "quant": model.quant_config.to_dict(),
        "calibrated_loops": model.calibrated_loops,
        "promoted": [name for name, g in groups.items() if g.spec.weight_slots > 1],
        "kernel": {"w_bits": 4, "group_size": GROUP_SIZE},
        "groups": {name: g.spec.to_dict() for name, g in groups.items()},
        "transition": _transition_layout(model.transition),
        "provenance": provenance,
        FILES: files or {},
    }
    return seal(described)


def _transition_layout(tr: TransitionAdapters | None) -> dict[str, Any] | None:
    return None if tr is None else {"num_loops": tr.num_transitions + 1, "rank": tr.u.shape[1], "eps": tr.eps}


def _unaliased_state(model: nn.Module) -> dict[str, Tensor]:
    """The state dict with tied parameters stored once (the structure re-ties them) and no shared storage."""
    aliases = tied_aliases(model)
    state: dict[str, Tensor] = {}
    seen: set[int] = set()
    for key, value in model.state_dict().items():
        if key in aliases:
            continue
        value = value.detach().cpu().contiguous()
        if value.data_ptr() in seen:  # safetensors cannot alias
            value = value.clone()
        seen.add(value.data_ptr())
        state[key] = value
    return state


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` of parameters registered under several names (e.g. a tied lm_head)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def export_files(teacher: str | None) -> list[str]:
    """The files besides the weights and description that an export of a student of ``teacher`` writes."""
    source = resolve_model_dir(teacher) if teacher else None
    if source is None or not (source / MODEL_CONFIG).is_file():
        return [MODEL_CONFIG]
    return [name for name in (MODEL_CONFIG, *TOKENIZER_FILES) if (source / name).is_file()]


def _copy_teacher_files(student: LoopLM, teacher: str | None, files: StagedFiles) -> dict[str, Path]:
    """The teacher's own config.json and tokenizer files (or the model's config when there is no teacher dir),
    staged; returns each name written with its staged file."""
    names = export_files(teacher)
    source = resolve_model_dir(teacher) if teacher else None
    if source is None or not (source / MODEL_CONFIG).is_file():
        return {MODEL_CONFIG: files.write(MODEL_CONFIG, lambda p: p.write_text(student.config_json() + "\n"))}
    return {name: files.write(name, lambda p, name=name: shutil.copyfile(source / name, p)) for name in names}


# ---------------------------------------------------------------------------------------------------- load
def read_export_meta(directory: str | Path) -> dict[str, Any]:
    """The checked, unsealed :data:`EXPORT_META` of an export directory: a hand-edited one (seal missing or
    broken, quant config other than its provenance's, promoted groups other than its layout's) is refused."""
    directory = Path(directory)
    path = directory / EXPORT_META
    if not path.is_file():
        raise ExportError(f"{path}: missing - {directory} is not a LoopQ export (run python -m loopq.export)")
    meta = read_json(path, ExportError, REEXPORT)
    if not isinstance(meta, dict):
        raise ExportError(f"{path}: not a JSON object; {REEXPORT}")
    if meta.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{path}: format {meta.get('format')!r} is not {EXPORT_FORMAT!r}; {REEXPORT}")
    meta = unseal(meta, path, ExportError, REEXPORT)
    check_quant_agrees(meta, path, ExportError, REEXPORT)
    promoted = [name for name, spec in meta["groups"].items() if PackedGroupSpec.from_dict(spec).weight_slots > 1]
    if sorted(meta["promoted"]) != sorted(promoted):
        raise ExportError(f"{path}: promoted {meta['promoted']} is not its layout's {promoted}; {REEXPORT}")
    return meta


def verify_export_files(directory: Path, meta: dict[str, Any]) -> None:
    """Every file the export's description lists has the recorded size and sha256 (one read of each)."""
    for name in dict.fromkeys((MODEL_CONFIG, EXPORT_WEIGHTS, *meta[FILES])):
        verify_file(directory, name, meta, EXPORT_META, ExportError, REEXPORT)


def load_quantized(
    directory: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    fold_norms: bool = True,
) -> LoopLM:
    """Rebuild an exported model; ``dtype`` casts the FP modules only (packed tensors keep their formats).
    ``fold_norms``: fold each RMSNorm that feeds one group only into that group's quantizer
    (:func:`~loopq.quant.packed.fold_feeding_norms`: fewer launches per decode step); ``False`` keeps the norms as
    modules of their own (e.g. to hook their outputs)."""
    directory = Path(directory)
    meta = read_export_meta(directory)
    verify_export_files(directory, meta)
    model = _skeleton(directory, meta)
    aliases = tied_aliases(model)
    state = _read_state(directory, meta, aliases, dtype)
    _check_packed_dtypes(directory, model, state, meta)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise ExportError(
            f"{directory / EXPORT_WEIGHTS}: tensors do not match {EXPORT_META} and config.json ({err})"
        ) from err
    for alias, name in aliases.items():  # assign=True replaced the tied parameter objects: tie them again
        parent, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(parent), attr, model.get_parameter(name))
    model.quant_config = QuantConfig.from_dict(meta["quant"])
    model.calibrated_loops = meta["calibrated_loops"]
    if fold_norms:
        fold_feeding_norms(model)
    return model.to(device).requires_grad_(False).eval()


def _skeleton(directory: Path, meta: dict[str, Any]) -> LoopLM:
    """The architecture on the meta device with packed groups and adapters in place (no data yet)."""
    config = read_config(directory)
    cls = architecture_for(config, str(directory / MODEL_CONFIG))
    with torch.device("meta"):
        model = cls(cls.config_from_dict(config))
        linear_groups = model.linear_groups()
        for name, spec in meta["groups"].items():
            if name not in linear_groups:
                raise ExportError(
                    f"{directory / EXPORT_META}: group {name!r} is not a linear group of the {cls.arch} model"
                )
            model.set_submodule(name, PackedLinearGroup(PackedGroupSpec.from_dict(spec)))
        if meta["transition"] is not None:
            t = meta["transition"]
            try:
                model.transition = TransitionAdapters(model.state_dim, t["num_loops"], t["rank"], t["eps"])
            except (ValueError, TypeError, KeyError) as err:  # an edited, re-sealed description: a traceback before
                raise ExportError(f"{directory / EXPORT_META}: transition {t}: {err}; {REEXPORT}") from None
    return model


def _check_packed_dtypes(directory: Path, model: LoopLM, state: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """Each packed tensor has the dtype its group's format gives it (``load_state_dict(assign=True)`` takes any):
    a re-sealed export with, say, int32 codes failed deep in a kernel with a traceback."""
    expected = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    for key, value in state.items():
        packed = key.startswith("transition.") or any(key.startswith(g + ".") for g in meta["groups"])
        want = expected.get(key)
        if packed and want is not None and value.dtype != want.dtype:
            raise ExportError(f"{directory / EXPORT_WEIGHTS}: {key} is {value.dtype}, not {want.dtype}; {REEXPORT}")


def _read_state(
    directory: Path, meta: dict[str, Any], aliases: dict[str, str], dtype: torch.dtype | None
) -> dict[str, Tensor]:
    path = directory / EXPORT_WEIGHTS
    if not path.is_file():
        raise ExportError(f"{path}: missing - the export in {directory} is incomplete; export again")
    state = read_safetensors(path, ExportError, REEXPORT)
    for alias, name in aliases.items():
        if name in state:
            state.setdefault(alias, state[name])
    if dtype is None:
        return state
    return {key: _cast_fp(key, value, dtype, meta) for key, value in state.items()}


def _cast_fp(key: str, value: Tensor, dtype: torch.dtype, meta: dict[str, Any]) -> Tensor:
    quantized = key.startswith("transition.") or any(key.startswith(g + ".") for g in meta["groups"])
    return value if quantized or not value.is_floating_point() else value.to(dtype)
