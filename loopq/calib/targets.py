"""Teacher targets, paid once: the FP teacher's top-k logits and loop trajectory for every calibration sample.

Calibration revisits each sample many times; the frozen teacher's outputs never change, so they are computed
once (``compute_targets``) and looked up by sample index. With a ``cache_dir`` they are written as one
safetensors file (memory-mapped on load, so multi-GB trajectories of real models stay on disk) keyed by the
teacher's content hash (:func:`loopq.provenance.teacher_fingerprint`: a teacher rebuilt in place gets new targets),
the samples and the settings; rank 0 writes it atomically, the other ranks wait and read it. The file's metadata
records the teacher hash, and a cache whose metadata names another teacher is refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from loopq.calib.losses import teacher_topk
from loopq.files import atomic_write, read_safetensors
from loopq.models.base import LoopLM
from loopq.provenance import ProvenanceError


@dataclass
class TeacherTargets:
    """``values``/``indices`` ``[N, S, k]`` (top-k teacher logits) and ``states`` ``[N, T, S, D]``."""

    values: Tensor
    indices: Tensor
    states: Tensor

    def batch(self, idx: Tensor, device: torch.device) -> tuple[Tensor, Tensor, list[Tensor]]:
        idx = idx.cpu()
        values = self.values[idx].to(device, torch.float32)
        indices = self.indices[idx].to(device, torch.long)
        states = self.states[idx].to(device, torch.float32)
        return values, indices, list(states.unbind(1))

    @property
    def num_loops(self) -> int:
        return self.states.shape[1]


#: samples per teacher forward while the targets are computed (its logits are the setup's largest transient:
#: :func:`loopq.planning.memory.target_pass_bytes`)
TARGET_BATCH = 8


@torch.no_grad()
def compute_targets(
    teacher: LoopLM,
    samples: Tensor,
    k: int,
    num_loops: int | None = None,
    batch_size: int = TARGET_BATCH,
    store_dtype: torch.dtype = torch.float16,
) -> TeacherTargets:
    """Run the teacher once over all samples (no grad) and keep what the loss needs, written into tensors allocated
    once for all samples (appending chunks and concatenating them held the targets twice at the end)."""
    device = next(teacher.parameters()).device
    out_values = out_indices = out_states = None
    start = 0
    for chunk in samples.split(batch_size):
        out = teacher(chunk.to(device), num_loops=num_loops, return_trajectory=True)
        # the vocabulary from the logits, not lm_head.weight (an empty placeholder under DeepSpeed ZeRO-3)
        index_dtype = torch.int16 if out.logits.shape[-1] <= torch.iinfo(torch.int16).max else torch.int32
        v, i = teacher_topk(out.logits, k)
        st = torch.stack(out.loop_states, dim=1)
        if out_values is None:
            n = samples.shape[0]
            out_values = torch.empty((n, *v.shape[1:]), dtype=store_dtype, device="cpu")
            out_indices = torch.empty((n, *i.shape[1:]), dtype=index_dtype, device="cpu")
            out_states = torch.empty((n, *st.shape[1:]), dtype=store_dtype, device="cpu")
        rows = slice(start, start + chunk.shape[0])
        out_values[rows] = v.to(store_dtype).cpu()
        out_indices[rows] = i.to(index_dtype).cpu()
        out_states[rows] = st.to(store_dtype).cpu()
        start += chunk.shape[0]
    if out_values is None:
        raise ValueError("compute_targets: no samples")
    return TeacherTargets(out_values, out_indices, out_states)


def cache_key(
    teacher_sha256: str, samples: Tensor, k: int, num_loops: int, dtype: torch.dtype, teacher_dtype: torch.dtype
) -> str:
    """Hash of everything the targets depend on (teacher content, samples, k, loops, storage dtype, and the dtype the
    teacher computes in: a bf16 and an fp32 teacher of the same files give other targets)."""
    h = hashlib.sha256(teacher_sha256.encode())
    h.update(samples.numpy().tobytes())
    h.update(f"{k}:{num_loops}:{dtype}:{teacher_dtype}".encode())
    return h.hexdigest()[:16]


def load_or_compute(
    teacher: LoopLM,
    teacher_sha256: str,
    samples: Tensor,
    k: int,
    num_loops: int,
    cache_dir: str | None,
    rank: int = 0,
    barrier: object | None = None,
    collective: bool = False,
) -> TeacherTargets:
    """In memory without ``cache_dir``; otherwise read the cache file, computing it (rank 0) if missing.

    ``collective``: the teacher's forward is a collective operation (DeepSpeed ZeRO-3 gathers its partitioned
    parameters), so when the file is missing every rank runs it and rank 0 writes the result.
    """
    if cache_dir is None:
        return compute_targets(teacher, samples, k, num_loops)
    key = cache_key(teacher_sha256, samples, k, num_loops, torch.float16, next(teacher.parameters()).dtype)
    path = Path(cache_dir) / f"teacher-targets-{key}.safetensors"
    missing = not path.is_file()
    if collective and callable(barrier):
        barrier()  # every rank has looked before rank 0 may write: they agree on `missing`
    if missing and (rank == 0 or collective):
        t = compute_targets(teacher, samples, k, num_loops)
        if rank == 0:
            tensors = {"values": t.values, "indices": t.indices, "states": t.states}
            meta = {"teacher_sha256": teacher_sha256}
            atomic_write(path, lambda p: save_file(tensors, str(p), metadata=meta))
            del tensors
        del t  # the file is read back below: the targets are not held twice
    if callable(barrier):
        barrier()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: teacher targets missing after rank 0 wrote them; is cache_dir shared?")
    with safe_open(str(path), "pt") as f:
        recorded = (f.metadata() or {}).get("teacher_sha256")
    if recorded is not None and recorded != teacher_sha256:
        raise ProvenanceError(
            f"{path}: teacher targets of teacher {recorded[:12]}, not of {teacher_sha256[:12]}; delete the file"
        )
    loaded = read_safetensors(path, fix="delete it: the targets are recomputed from the teacher")
    return TeacherTargets(loaded["values"], loaded["indices"], loaded["states"])
