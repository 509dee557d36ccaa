"""Descriptions that cannot lie: a content manifest of every file an artifact holds, sealed with its description.

A student's or export's description (:data:`~loopq.artifacts.layout.STUDENT_META`,
:data:`~loopq.artifacts.layout.EXPORT_META`) records, under :data:`FILES`, the size and sha256 of every file
written with it (:func:`manifest`), and is sealed by :data:`SEAL` - the sha256 of the canonical JSON of everything
else in it (:func:`seal`). A reader of the current format versions

* refuses a description without a seal, or whose seal does not match (:func:`unseal`): an edited ``a_bits`` would
  run the tensors with other bits than they were made with and label the result so;
* refuses a file whose size or sha256 is not the recorded one (:func:`verify_file`): flipped bytes, or another
  model's weights copied in, would otherwise load silently;
* refuses a description whose quant config disagrees with the config its own provenance recorded
  (:func:`check_quant_agrees`).

The seal is a consistency check, not a signature: whoever rewrites the file and its seal on purpose is not stopped.
The cost is one sequential read of each weight file (the page cache then serves the load), measured in the
README's reliability section.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loopq.provenance import json_digest

SEAL = "meta_sha256"
FILES = "files"


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, read once in 1 MiB chunks (never memoised: the file may have been replaced)."""
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def manifest(directory: Path, names: Iterable[str] | dict[str, Path]) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "sha256"}}`` of the named files of ``directory`` (those that exist); ``names`` may map each
    name to the file to read for it (a staged file, :func:`loopq.files.staged_files`, before its rename)."""
    paths = names if isinstance(names, dict) else {name: Path(directory) / name for name in names}
    entries = {}
    for name, path in paths.items():
        if Path(path).is_file():
            entries[name] = {"size": Path(path).stat().st_size, "sha256": sha256_file(Path(path))}
    return entries


def seal(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with :data:`SEAL` set to the digest of everything else in it."""
    body = {k: v for k, v in meta.items() if k != SEAL}
    return {**body, SEAL: json_digest(body)}


def unseal(meta: dict[str, Any], path: Path, error: type[Exception], fix: str) -> dict[str, Any]:
    """``meta`` without its seal, after checking it: a missing or broken seal raises ``error`` naming ``path``."""
    body = {k: v for k, v in meta.items() if k != SEAL}
    if SEAL not in meta:
        raise error(f"{path}: has no {SEAL} seal, so its bits and layout cannot be trusted; {fix}")
    if meta[SEAL] != json_digest(body):
        raise error(
            f"{path}: edited after it was written (its content no longer matches {SEAL}), so its bits and layout "
            f"may not be what the tensors were made with; {fix}"
        )
    return body


def verify_file(
    directory: Path, name: str, meta: dict[str, Any], meta_name: str, error: type[Exception], fix: str
) -> Path:
    """Check ``directory/name`` against the size and sha256 its description recorded; returns its path."""
    path = Path(directory) / name
    entry = (meta.get(FILES) or {}).get(name)
    if entry is None:
        raise error(f"{Path(directory) / meta_name}: records no content hash of {name}; {fix}")
    if not path.is_file():
        raise error(f"{path}: missing - the directory is incomplete; {fix}")
    size = path.stat().st_size
    digest = sha256_file(path) if size == entry["size"] else None
    if digest != entry["sha256"]:
        found = f"{size} bytes" if digest is None else f"sha256 {digest[:12]}"
        recorded = f"{entry['size']} bytes" if digest is None else f"sha256 {entry['sha256'][:12]}"
        raise error(
            f"{path}: not the file {meta_name} was written with ({found}, recorded {recorded}): it was changed or "
            f"replaced since; {fix}"
        )
    return path


def check_quant_agrees(meta: dict[str, Any], path: Path, error: type[Exception], fix: str) -> None:
    """The description's quant config must be the one its provenance recorded (``model.quant.*`` keys)."""
    config = ((meta.get("provenance") or {}).get("config")) or {}
    for key, value in (meta.get("quant") or {}).items():
        recorded = config.get(f"model.quant.{key}", value)
        if recorded != value:
            raise error(
                f"{path}: quant.{key}={value!r} but its own provenance says model.quant.{key}={recorded!r}: the "
                f"description was edited into another model; {fix}"
            )
