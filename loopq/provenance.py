"""Provenance: which teacher and which resolved config produced an artifact, recorded and compared.

Every artifact a run writes (teacher-target cache, calibration checkpoint, student, export, result JSON) records

* ``teacher_sha256`` - a content hash of the teacher directory's weights, config and tokenizer files
  (:func:`teacher_fingerprint`): a teacher rebuilt in place, or copied elsewhere, is recognised by what it holds,
  not by its path or modification time;
* ``config`` - the resolved calibration config, flattened to dotted keys (the options that cannot change the
  result, :data:`loopq.fit.COSMETIC`, left out);
* ``environment`` - the Python, package versions and CPU it ran with (:func:`environment`). Recorded, never
  compared: calibration is deterministic on one machine and environment but not bit-reproducible across them
  (a 1e-7 relative change of the teacher's weights moves step 0's sharing gaps S_l by up to 17 %, see
  docs/results.md), so results from two environments are two samples, and this says which rows share one.

Readers compare the record with what they are about to combine it with and refuse a mismatch with one line naming
the differing keys (:func:`check_same`); each CLI offers an explicit override where a user may really want one.
This module sits at the bottom of the package: it imports only :mod:`loopq.errors`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from loopq.errors import LoopQError

#: files of a model directory whose bytes define the teacher (weights, shapes and tokenizer): every weight format
#: the loader reads (safetensors, sharded or not, and Parcae's pytorch_model.bin) and every tokenizer format
#: (tokenizer.json, GPT-2's encoder.json + vocab.bpe); a file a directory lacks changes nothing
TEACHER_FILE_PATTERNS = (
    "config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model.bin",
    "tokenizer.json", "encoder.json", "vocab.bpe",
)  # fmt: skip

_FILE_MEMO: dict[tuple[str, int, int], str] = {}


class ProvenanceError(LoopQError):
    """An artifact was made from another teacher or config than the one it is used with; the message names what."""


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (memoised per path, size and mtime within the process: multi-GB shards once)."""
    p = Path(path).resolve()
    stat = p.stat()
    key = (str(p), stat.st_size, stat.st_mtime_ns)
    if key not in _FILE_MEMO:
        with p.open("rb") as f:
            _FILE_MEMO[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _FILE_MEMO[key]


def teacher_fingerprint(directory: str | Path) -> str:
    """Content hash of a model directory: sha256 over (name, sha256) of its weight, config and tokenizer files.

    File names enter the hash, paths and timestamps do not: a copy of a teacher in another place has the same
    fingerprint, a teacher retrained in place a different one."""
    root = Path(directory).resolve()
    files = sorted({f for pattern in TEACHER_FILE_PATTERNS for f in root.glob(pattern) if f.is_file()})
    if not files:
        raise ProvenanceError(f"{root}: no config.json or weights to fingerprint; is it a model directory?")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def json_digest(value: Any) -> str:
    """sha256 of ``value``'s canonical JSON (sorted keys, no whitespace): a digest of a record's content."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict of dotted keys (``{"model": {"lr": 1}}`` -> ``{"model.lr": 1}``); leaves as JSON
    gives them back (tuples -> lists), so a stored record and a live one compare equal."""
    flat: dict[str, Any] = {}
    if isinstance(value, dict) and value:
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}{key}."))
    elif prefix:
        flat[prefix[:-1]] = json.loads(json.dumps(value, default=str))
    return flat


def differing_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two flat records (a key missing on one side differs)."""
    missing = object()
    return [k for k in sorted(set(old) | set(new)) if old.get(k, missing) != new.get(k, missing)]


def describe(keys: list[str], old: dict[str, Any], new: dict[str, Any], limit: int = 4) -> str:
    """``key: old -> new`` for the first ``limit`` differing keys (and how many more)."""
    shown = [f"{k}: {_short(old.get(k))} -> {_short(new.get(k))}" for k in keys[:limit]]
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return "; ".join(shown) + more


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a sha256: its head is enough to tell two apart
    return text if len(text) <= 40 else text[:37] + "..."


def check_same(recorded: dict[str, Any], current: dict[str, Any], what: str, fix: str) -> None:
    """Refuse (:class:`ProvenanceError`) when two flat provenance records differ in any key (or one lacks it).

    ``what`` names the artifact (``runs/x/checkpoints/last.ckpt was calibrated``), ``fix`` what the user can do."""
    keys = differing_keys(recorded, current)
    if keys:
        kind = "teacher" if keys == ["teacher_sha256"] else "config"
        raise ProvenanceError(f"{what} with another {kind} ({describe(keys, recorded, current)}); {fix}")


#: the packages whose versions can change a calibration's numbers
ENVIRONMENT_PACKAGES = ("torch", "lightning", "transformers", "tokenizers", "jsonargparse", "numpy", "triton")


def environment() -> dict[str, str]:
    """Python, the :data:`ENVIRONMENT_PACKAGES` versions (``absent`` when not installed) and the CPU."""
    info = _cpuinfo()
    env = {"python": platform.python_version(), "machine": platform.machine(), "cpu": _cpu_model(info)}
    env["cpu_isa"] = widest_isa(_cpu_flags(info))
    env["cpu_paths"] = cpu_paths()
    for name in ENVIRONMENT_PACKAGES:
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = "absent"
    return env


def cpu_paths() -> str:
    """The CPU code paths that decide fp32 summation order (``loopq``'s docstring): ATen's capability in use and the
    MKL / oneDNN settings, e.g. ``aten AVX2, MKL_CBWR AVX2, ONEDNN_MAX_CPU_ISA AVX2``."""
    import torch

    parts = [f"aten {torch.backends.cpu.get_cpu_capability()}"]
    parts += [f"{name} {os.environ.get(name, 'unset')}" for name in ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA")]
    return ", ".join(parts)


def widest_isa(flags: set[str]) -> str:
    """The widest x86 vector instruction set among a CPU's ``/proc/cpuinfo`` flags: ``AVX512`` (``avx512f``),
    ``AVX2`` or ``default``; ``unknown`` without flags (not Linux, or not x86). Recorded beside
    :func:`cpu_paths` so a result says whether the pin of ``loopq/__init__.py`` was what kept an AVX-512 machine on
    the AVX2 paths (docs/results.md, "What moves a calibration between machines")."""
    if not flags:
        return "unknown"
    if "avx512f" in flags:
        return "AVX512"
    return "AVX2" if "avx2" in flags else "default"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_field(info: str, name: str) -> str | None:
    """The value of the first ``name : value`` line of ``/proc/cpuinfo`` text, None when absent."""
    for line in info.splitlines():
        if line.split(":", 1)[0].strip() == name:
            return line.split(":", 1)[1].strip()
    return None


def _cpu_flags(info: str) -> set[str]:
    return set((_cpu_field(info, "flags") or "").split())


def _cpu_model(info: str) -> str:
    return _cpu_field(info, "model name") or platform.processor() or "unknown"


def record(teacher_sha256: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The provenance block artifacts store: the teacher's fingerprint, when known the flat resolved config, and
    the environment (recorded, not compared by :func:`flat_record`)."""
    out: dict[str, Any] = {"teacher_sha256": teacher_sha256}
    if config is not None:
        out["config"] = config
    out["environment"] = environment()
    return out


#: options added after records were written, with the value every older record calibrated with: a record without
#: the key is read as having that value (a student or checkpoint from before the option existed is not "another
#: config" for it)
LATER_OPTIONS = {"model.state_reduction": "mean", "model.student_from": "last"}

#: options removed since records were written, with the value that means what the current code does (the
#: schedules moved to the callbacks' arguments, whose defaults are these): a record holding that value is not
#: "another config"; one holding another value is
RETIRED_OPTIONS = {
    "model.mu_every_n_steps": 100,
    "model.slt_start_step": 0,
    "model.slt_every_n_steps": 50,
    "model.slt_per_round": 1,
    "model.slt_probe_batches": 2,
}


def flat_record(block: dict[str, Any] | None) -> dict[str, Any]:
    """A provenance block as one flat dict for :func:`check_same` (``teacher_sha256`` + ``config.*`` keys)."""
    block = block or {}
    flat = {"teacher_sha256": block.get("teacher_sha256")}
    config = block.get("config") or {}
    if config:
        config = {**LATER_OPTIONS, **config}
        config = {k: v for k, v in config.items() if k not in RETIRED_OPTIONS or RETIRED_OPTIONS[k] != v}
    flat.update({f"config.{k}": v for k, v in config.items()})
    return flat
