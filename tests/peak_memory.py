"""The memory a ``loopq.fit`` run adds to its process, measured from the kernel's accounting (for tests/test_plan.py).

    python -m tests.peak_memory <loopq.fit arguments>     # prints {"baseline": bytes, "peak": bytes}

torch's CPU allocator keeps no statistics and tracemalloc does not see its allocations, so this reads the process's
resident set: everything is imported and one small warm-up calibration runs first (lazy imports, thread pools,
kernel caches), freed heap is handed back (``malloc_trim``), then the peak-RSS mark is reset (``/proc/self/clear_refs``
``5``: VmHWM := VmRSS) and the run under test starts. ``peak - baseline`` is what the run needed at its worst moment.
Run it with ``MALLOC_MMAP_THRESHOLD_`` fixed (the test does) so that freed tensors leave the resident set at once.
"""

import ctypes
import gc
import json
import sys
import tempfile
from pathlib import Path

from loopq.commands import fit

WARM_UP = ("--data.num_samples", "4", "--data.seq_len", "16", "--data.batch_size", "1", "--trainer.max_steps", "1")


def status_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process from ``/proc/self/status``, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def settle() -> int:
    """Collect garbage, return freed heap to the kernel, reset the peak mark; the resident set now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def main(args: list[str]) -> None:
    with tempfile.TemporaryDirectory() as warm:
        fit.main([*args, *WARM_UP, "--trainer.default_root_dir", warm])
    baseline = settle()
    fit.main(args)
    print(json.dumps({"baseline": baseline, "peak": status_bytes("VmHWM")}))


if __name__ == "__main__":
    main(sys.argv[1:])
