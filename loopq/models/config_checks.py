"""Checks of a teacher directory before a model is built from it: its ``config.json`` values, the config against the
weight files' headers, and the weights' values.

* **Types** (:func:`check_config_types`). Each architecture's config dataclass declares its fields' types; a
  ``config.json`` value of another type (``"hidden_size": "128"``, ``"total_ut_steps": 1.5``, ``true`` for a count) is
  refused naming the key, and so is a count below 1 (every ``int`` field of the three architectures is a size or a
  count, :data:`MAY_BE_ZERO` aside; ``total_ut_steps: 0`` would run no loop).
* **Against the header** (:func:`check_layer_count`, :func:`check_against_header`). A config is checked against the
  weight files before a model is built, even on the meta device: building a million layers to compare shapes is
  itself the damage (112 s, 5.2 GB). The layer count an architecture reads from its config
  (``LoopLM.layer_count_fields``) may not exceed the number of tensors the files hold (every layer stores its own);
  then the model is built on the meta device and matched against meta tensors of the header's shapes and dtypes
  (the strict-load check of :meth:`LoopLM.match_native`, without reading a weight). An architecture that compares a
  stored buffer by value first (Parcae's RoPE table) cannot be matched on meta: its shapes are checked by the load.
* **Values** (:func:`check_finite`). A NaN or infinite weight makes every output NaN; calibration then fails later
  blaming the learning rate, evaluation writes ``ppl: NaN``. Each tensor is scanned once, in chunks of
  :data:`CHUNK` elements (no full-size temporary), and the first non-finite one is refused naming it and its file.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from loopq.errors import LoopLMError

#: integer config fields that may be 0 (Parcae's optional prelude / coda layers, an unset position offset)
MAY_BE_ZERO = frozenset({"n_layers_in_prelude", "n_layers_in_coda", "randomize_positions_from"})
#: elements scanned at a time by :func:`check_finite`
CHUNK = 1 << 22
#: safetensors dtype names -> torch dtypes (the header's spelling)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _allowed(hint: Any) -> tuple[type, ...]:
    """The Python types a field annotated ``hint`` accepts (``int | None`` -> (int, NoneType))."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in _allowed(arg))
    if hint is Any:
        return (object,)
    if origin is not None:
        return (origin,)
    return (hint,) if isinstance(hint, type) else (object,)


def value_problem(value: Any, allowed: tuple[type, ...], least: int = 1) -> str | None:
    """Why ``value`` does not fit a field accepting ``allowed``; None if it does. ``bool`` is not an ``int`` here,
    an ``int`` is a ``float``, and an ``int`` (a size or count) must be at least ``least``."""
    if object in allowed:
        return None
    if value is None:
        return None if type(None) in allowed else "null, but a value is required"
    if isinstance(value, bool):
        return None if bool in allowed else "a boolean"
    if isinstance(value, int) and int in allowed:
        return None if value >= least else f"{value}, but it is a size or count and must be >= {least}"
    if isinstance(value, (int, float)) and float in allowed:
        return None if math.isfinite(value) else f"{value}, not a finite number"
    if isinstance(value, tuple(t for t in allowed if t not in (int, float, bool, type(None)))):
        return None
    return f"a {type(value).__name__} ({value!r})"


def check_config_types(config_class: type, native: Mapping[str, Any], source: str = "config.json") -> None:
    """Every ``config.json`` key that is a field of ``config_class`` holds a value of the field's type (module
    docstring); :class:`LoopLMError` naming the key otherwise."""
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        if field.name == "extra" or field.name not in native:
            continue
        allowed = _allowed(hints[field.name])
        problem = value_problem(native[field.name], allowed, 0 if field.name in MAY_BE_ZERO else 1)
        if problem is not None:
            want = " or ".join(sorted({t.__name__ if t is not type(None) else "null" for t in allowed}))
            raise LoopLMError(f"{source}: {field.name} is {problem}; it must be {want}")


def layer_count(cls: Any, config: Any) -> int:
    """The layers a config describes (the sum of the architecture's ``layer_count_fields``)."""
    return sum(int(getattr(config, name)) for name in cls.layer_count_fields)


def check_layer_count(cls: Any, config: Any, stored: int, source: Path | str) -> None:
    """A config may not describe more layers than the weight files hold tensors (module docstring)."""
    layers = layer_count(cls, config)
    if layers > stored:
        fields = " + ".join(f"{name}={getattr(config, name)}" for name in cls.layer_count_fields)
        raise LoopLMError(
            f"{source}: {fields} describes {layers} layers, but the weight files hold only {stored} tensors; the "
            "config does not describe these weights"
        )


def header_tensors(directory: Path) -> dict[str, Tensor] | None:
    """Meta tensors of the shapes and dtypes the safetensors headers of a model directory declare (one
    ``model.safetensors`` or the shards of its index); None when the weights are not safetensors. Reads the headers
    only."""
    from loopq.models.shards import INDEX_FILE, SINGLE_FILE, read_index

    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = [directory / shard for shard in sorted(set(read_index(index).values()))]
    else:
        return None
    out: dict[str, Tensor] = {}
    for path in files:
        out.update(header_of(path))
    return out


def header_of(path: Path) -> dict[str, Tensor]:
    """Meta tensors of one safetensors file's header; a missing, empty or truncated file raises
    :class:`LoopLMError` naming it (``safe_open``'s own error, ``header too small``, named no file)."""
    from safetensors import SafetensorError, safe_open

    from loopq.models.shards import REFETCH

    out: dict[str, Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                part = f.get_slice(key)
                dtype = SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32)
                out[key] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
    except (SafetensorError, OSError) as err:
        raise LoopLMError(f"{path}: not a readable safetensors file, truncated or corrupt ({err}); {REFETCH}") from None
    return out


def check_against_header(cls: Any, config: Any, directory: Path) -> None:
    """``config`` (of architecture ``cls``) describes exactly the tensors the safetensors headers of ``directory``
    declare - names, shapes, dtype kinds - checked on the meta device after the layer-count bound."""
    header = header_tensors(directory)
    if header is None:
        return
    check_layer_count(cls, config, len(header), directory / "config.json")
    with torch.device("meta"):
        model = cls(config)
    try:
        model.match_native(header, str(directory))
    except RuntimeError:  # a buffer compared by value (Parcae's RoPE table) cannot be on meta: the load checks it
        return


def check_finite(tensors: Mapping[str, Tensor], origins: Mapping[str, Any] | None = None) -> None:
    """Refuse the first floating-point tensor holding a NaN or an infinity, naming it and its file (module
    docstring)."""
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), CHUNK):
            if not bool(torch.isfinite(flat[start : start + CHUNK]).all()):
                where = (origins or {}).get(name, "the weights")
                raise LoopLMError(
                    f"{where}: tensor {name!r} holds NaN or infinite values; the weights are damaged - re-download "
                    "or re-export the model"
                )
