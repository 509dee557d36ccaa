"""Loading looped LMs from each architecture's native published format.

A model directory is ``config.json`` plus weights in the Hugging Face layout (:mod:`loopq.models.shards`): one
``model.safetensors`` or shards with ``model.safetensors.index.json``, checked against each other; bf16 or any other
dtype, shards in any order. ``config.json`` fields that only serve ``transformers`` (``auto_map`` to remote code,
``architectures``, ``torch_dtype`` / ``dtype``, ``transformers_version``) are kept but never executed or obeyed: the
model is fp32 unless ``dtype`` is passed. A published ``pytorch_model.bin`` (Parcae releases one) is read with
``torch.load(weights_only=True)`` only - never a full unpickle. Writing is :meth:`LoopLM.save_pretrained`
(atomically; sharded with ``max_shard_size``). The generic file helpers (``atomic_write``, ``read_json``,
``read_safetensors``) live in :mod:`loopq.files` and are re-exported here for older imports.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from loopq.files import atomic_write, read_json, read_json_object, read_safetensors
from loopq.models.base import LoopLM, LoopLMError
from loopq.models.config_checks import check_finite, check_layer_count
from loopq.models.shards import INDEX_FILE, SINGLE_FILE, Weights, read_sharded, read_single


def architectures() -> dict[str, type[LoopLM]]:
    """All registered looped architectures by name."""
    from loopq.models.loopformer import LoopFormerLM
    from loopq.models.ouro import OuroLM
    from loopq.models.parcae import ParcaeLM

    return {cls.arch: cls for cls in (OuroLM, LoopFormerLM, ParcaeLM)}


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise LoopLMError(f"{path}: no config.json; point `path` at a model directory (config.json + weights)")
    return read_json_object(path, LoopLMError, "fix it or re-download the model")


def architecture_for(config: Mapping[str, Any], source: str = "config.json") -> type[LoopLM]:
    """Pick the architecture whose ``matches`` accepts this native config."""
    found = [cls for cls in architectures().values() if cls.matches(config)]
    if not found:
        kind = config.get("model_type", config.get("_class_name", "<none>"))
        raise LoopLMError(
            f"{source}: unknown architecture (model_type/_class_name = {kind!r}); supported: {sorted(architectures())}"
        )
    return found[0]


def _read_torch_bin(path: Path) -> dict[str, Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refuses arbitrary objects: exactly what we want to report
        raise LoopLMError(f"{path}: not a plain tensor state dict (refusing to unpickle objects): {err}") from err
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise LoopLMError(f"{path}: expected a flat dict of tensors")
    return state


def read_weight_files(directory: Path) -> Weights:
    """A model directory's tensors with the file that describes them and the file of each tensor: ``model.safetensors``
    (preferred, as ``transformers`` does), else the sharded layout (index checked against its shards), else a
    weights-only ``pytorch_model.bin``."""
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():
        return read_single(single)
    if index.is_file():
        return read_sharded(directory)
    binary = directory / "pytorch_model.bin"
    if binary.is_file():
        tensors = _read_torch_bin(binary)
        return Weights(tensors, binary, dict.fromkeys(tensors, binary))
    for path in (single, index, binary):  # present, but not a file: say so rather than "not found"
        if path.exists():
            kind = "a directory" if path.is_dir() else "not a regular file"
            raise LoopLMError(f"{path}: {kind}, not the weights file; replace it with the model's weights")
    raise LoopLMError(f"{directory}: no {SINGLE_FILE} (or {INDEX_FILE} / pytorch_model.bin) found")


def read_weights(directory: Path) -> dict[str, Tensor]:
    """A model directory's tensors by native name (see :func:`read_weight_files`)."""
    return read_weight_files(directory).tensors


#: what a hub id downloads: config, weights (single, sharded or .bin), tokenizer, its config (the chat template of
#: the Thinking variants; newer ``transformers`` save it as ``chat_template.jinja``) and the generation defaults
HUB_FILES = [
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model.bin",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
]


def resolve_model_dir(path: str | os.PathLike[str]) -> Path:
    """A local directory as is; ``org/name`` that is not a local path is fetched from the Hugging Face hub
    (only for users with hub access - set ``HF_HUB_OFFLINE=1`` to forbid it; tests always do). A path whose first
    part is a local folder (``runs/teacher``, ``teacher/tokenizer.json``) is local even when it does not exist: the
    caller then says what is missing instead of "could not be fetched from the hub"."""
    directory = Path(path)
    text = str(path)
    if directory.exists() or text.count("/") != 1 or text.startswith((".", "/")) or directory.parent.is_dir():
        return directory
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=text, allow_patterns=HUB_FILES))
    except Exception as err:  # offline, unknown repo, no access: one actionable line
        raise LoopLMError(
            f"{text}: not a local directory and could not be fetched from the hub ({type(err).__name__}); "
            "download the model and pass its directory"
        ) from err


def load_looplm(path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> LoopLM:
    """Load a looped LM from a directory in its native format (or a hub id, see :func:`resolve_model_dir`);
    eval mode, fp32 unless ``dtype`` is given (whatever ``config.json``'s ``torch_dtype`` says). The checkpoint's
    tensors become the parameters in that dtype directly (:meth:`LoopLM.from_native`): a bf16 checkpoint loaded with
    ``dtype=torch.bfloat16`` is never copied to fp32."""
    directory = resolve_model_dir(path)
    if not directory.is_dir():
        raise LoopLMError(f"{directory}: not a directory; pass the folder holding config.json and the weights")
    config = read_config(directory)
    cls = architecture_for(config, str(directory / "config.json"))
    config_obj = cls.config_from_dict(config)
    weights = read_weight_files(directory)
    check_layer_count(cls, config_obj, len(weights.tensors), directory / "config.json")
    check_finite(weights.tensors, weights.origins)
    model = cls.from_native(config_obj, weights.tensors, str(weights.source), dtype or torch.float32, weights.origins)
    return model.eval()


__all__ = [
    "architecture_for",
    "architectures",
    "atomic_write",
    "load_looplm",
    "read_config",
    "read_json",
    "read_safetensors",
    "read_weight_files",
    "read_weights",
    "resolve_model_dir",
]
