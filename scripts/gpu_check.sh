#!/usr/bin/env bash
# One GPU check of LoopQ: compiled Triton kernel tests, the W4A4/W4A8 kernel benchmark at Ouro-1.4B's shapes, a bf16
# calibration of the tiny teacher on cuda and a real-shape step timing, printed as one table (docs/benchmarks.md,
# "GPU check"). Exits 1 if a stage failed; without a CUDA GPU it says so and exits 0.
#
#   scripts/gpu_check.sh [--quick] [--out results/gpu_check.json] [--skip STAGE ...]
#
# Python: $PYTHON if set, else this checkout's .venv, else python3 on PATH. This checkout's loopq comes first on
# PYTHONPATH, and TRITON_INTERPRET=0 so the compiled kernels run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python="python3"; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0
exec "$python" -m loopq.gpu_check "$@"
