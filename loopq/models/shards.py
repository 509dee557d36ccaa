"""The Hugging Face weights layout of a model directory, read strictly and written atomically.

A directory holds either one ``model.safetensors`` or shards ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``::

    {"metadata": {"total_size": <bytes of all tensors>}, "weight_map": {"<tensor name>": "<shard file>", ...}}

This is what the published Ouro checkpoints use and what ``transformers``' ``save_pretrained(max_shard_size=...)``
writes. Reading checks the index against the shards before any tensor is used: every shard it names exists, every
tensor it lists is in the shard it names, every tensor of a shard is listed (under that shard), so no tensor is in
two shards; each violation is one line naming the file and the tensor. Writing fills shards in state-dict order up
to ``max_shard_size`` (a tensor larger than that gets a shard of its own), as ``transformers`` does, keeps every
tensor's dtype, writes each file with :func:`~loopq.files.atomic_write` and removes weights files of an earlier
save that the new one does not use.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from loopq.errors import LoopLMError
from loopq.files import atomic_write, read_json, read_safetensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
REFETCH = "re-download the model (or re-save it)"
#: units of ``max_shard_size`` strings, as ``transformers`` reads them (``"5GB"`` is 5 * 10**9 bytes)
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass
class Weights:
    """The tensors of a model directory, the file that describes them (``model.safetensors``, the index or a
    ``pytorch_model.bin``) and, per tensor, the file that holds it (for error messages)."""

    tensors: dict[str, Tensor]
    source: Path
    origins: dict[str, Path] = field(default_factory=dict)


def shard_name(index: int, count: int) -> str:
    """``model-00002-of-00003.safetensors`` for shard 2 of 3 (1-based)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def parse_size(size: int | str) -> int:
    """Bytes from ``max_shard_size``: an int, or ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` as ``transformers`` reads them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size) if isinstance(size, str) else None
    unit = SIZE_UNITS.get(match.group(2).upper()) if match else None
    value = int(float(match.group(1)) * unit) if match and unit else size
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoopLMError(
            f"max_shard_size={size!r} is not a size; give bytes (an int >= 1) or a string like '5GB', '500MB', '2GiB'"
        )
    return value


def plan_shards(state: Mapping[str, Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names per shard: in ``state`` order, a new shard whenever the next tensor would overflow the current
    one (a tensor larger than ``max_bytes`` is alone in its shard)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_weights(directory: Path, state: Mapping[str, Tensor], max_shard_size: int | str | None = None) -> list[Path]:
    """Write ``state`` (contiguous CPU tensors, no two sharing memory) as ``model.safetensors``, or, when it exceeds
    ``max_shard_size``, as shards plus the index; returns the files written. Weights files of an earlier save that
    this one does not use are removed (the single file before the index is written, so that a crash in between
    leaves no stale model that would load)."""
    shards = [list(state)] if max_shard_size is None else plan_shards(state, parse_size(max_shard_size))
    if len(shards) == 1:
        written = [_write_safetensors(directory / SINGLE_FILE, state)]
        _remove(directory, keep=set(), index=True)
        return written
    names = [shard_name(i + 1, len(shards)) for i in range(len(shards))]
    written = [
        _write_safetensors(directory / n, {k: state[k] for k in keys}) for n, keys in zip(names, shards, strict=True)
    ]
    (directory / SINGLE_FILE).unlink(missing_ok=True)
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
        "weight_map": {key: name for name, keys in zip(names, shards, strict=True) for key in sorted(keys)},
    }
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"
    atomic_write(directory / INDEX_FILE, lambda p: p.write_text(text, encoding="utf-8"))
    _remove(directory, keep=set(names), index=False)
    return [*written, directory / INDEX_FILE]


def _write_safetensors(path: Path, state: Mapping[str, Tensor]) -> Path:
    atomic_write(path, lambda p: save_file(dict(state), str(p), metadata={"format": "pt"}))
    return path


def _remove(directory: Path, keep: set[str], index: bool) -> None:
    """Delete shard files not in ``keep`` (and the index when ``index``): what an earlier save left behind."""
    for path in directory.glob("model-*-of-*.safetensors"):
        if SHARD_FILE.fullmatch(path.name) and path.name not in keep:
            path.unlink()
    if index:
        (directory / INDEX_FILE).unlink(missing_ok=True)


def read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` of an index file (tensor name -> shard file name), checked for shape: an object of strings,
    no tensor named twice, plain ``*.safetensors`` file names in the same directory."""
    data = read_json(path, LoopLMError, REFETCH)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise LoopLMError(f"{path}: no 'weight_map' object (tensor name -> shard file); {REFETCH}")
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise LoopLMError(
                f"{path}: 'weight_map' sends {key!r} to {shard!r}, not a .safetensors file name; {REFETCH}"
            )
    twice = _keys_named_twice(path.read_text(encoding="utf-8"))
    if twice:
        raise LoopLMError(f"{path}: 'weight_map' lists {twice[0]!r} more than once (one tensor, one shard); {REFETCH}")
    return weight_map


def _keys_named_twice(text: str) -> list[str]:
    """Keys repeated inside one JSON object of ``text`` (``json`` itself silently keeps the last)."""
    repeated: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        repeated.extend(key for key, n in Counter(key for key, _ in items).items() if n > 1)
        return dict(items)

    json.loads(text, object_pairs_hook=pairs)
    return repeated


def read_sharded(directory: Path) -> Weights:
    """Every tensor of a sharded directory, after checking the index against the shards (see the module docstring)."""
    index = directory / INDEX_FILE
    weight_map = read_index(index)
    tensors: dict[str, Tensor] = {}
    origins: dict[str, Path] = {}
    for shard in sorted(set(weight_map.values())):
        path = directory / shard
        if not path.is_file():
            raise LoopLMError(f"{index}: names shard {shard!r}, which is not in {directory}; {REFETCH}")
        for key, tensor in read_safetensors(path, LoopLMError, REFETCH).items():
            _check_listed(index, path, key, weight_map.get(key))
            tensors[key], origins[key] = tensor, path
    for key, shard in weight_map.items():
        if key not in tensors:
            raise LoopLMError(f"{index}: lists {key!r} in {shard!r}, which does not hold it; {REFETCH}")
    return Weights(tensors, index, origins)


def _check_listed(index: Path, shard: Path, key: str, listed: str | None) -> None:
    """A tensor found in ``shard`` must be listed in the index under that shard."""
    if listed is None:
        raise LoopLMError(f"{shard}: holds {key!r}, which {index.name} does not list; {REFETCH}")
    if listed != shard.name:
        raise LoopLMError(
            f"{shard}: holds {key!r}, which {index.name} places in {listed!r}; a tensor must be in exactly one "
            f"shard: {REFETCH}"
        )


def read_single(path: Path) -> Weights:
    """The tensors of one ``model.safetensors``."""
    tensors = read_safetensors(path, LoopLMError, REFETCH)
    return Weights(tensors, path, dict.fromkeys(tensors, path))
