#!/usr/bin/env bash
# The GPU check of LoopQ (docs/benchmarks.md, "On a GPU"): stages in order of importance, each under its own time
# limit inside a total budget (default 480 s), one table printed, and with --out DIR the results written to
# DIR/gpu_check.json and DIR/gpu_check.md after every stage (and the output to DIR/gpu_check.log). Exits 1 if a
# stage failed or was cut; without a CUDA GPU it says so and exits 0.
#
#   scripts/gpu_check.sh [--carry .gpu-carry] [--out DIR] [--full] [--budget S] [--only STAGE ...] [--skip STAGE ...]
#
# --carry DIR (built by scripts/gpu_carry.sh): first installs DIR/wheels offline into a target folder put on
# PYTHONPATH, and unpacks DIR/data.tar.xz into the folder LOOPQ_SHARED then points at - for a machine with no network
# whose Python lacks those packages. Python: $PYTHON if set, else this checkout's .venv, else python3 on PATH. This
# checkout's loopq comes first on PYTHONPATH, and TRITON_INTERPRET=0 so the compiled kernels run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python="python3"; fi
fi
carry="" out="" args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --carry) [[ $# -ge 2 ]] || { echo "error: --carry needs a folder (built by scripts/gpu_carry.sh)" >&2; exit 2; }
             carry="$2"; shift 2 ;;
    --out) args+=("$1"); shift
           if [[ $# -gt 0 ]]; then out="$1"; args+=("$1"); shift; fi ;;
    *) args+=("$1"); shift ;;
  esac
done
site=""
if [[ -n "$carry" ]]; then
  [[ -d "$carry/wheels" && -f "$carry/data.tar.xz" ]] \
    || { echo "error: --carry $carry: no wheels/ and data.tar.xz there; build it with scripts/gpu_carry.sh" >&2; exit 2; }
  work="$(mktemp -d "${TMPDIR:-/tmp}/loopq-carry.XXXXXX")"
  site="$work/site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$carry"/wheels/*.whl
  tar -xJf "$carry/data.tar.xz" -C "$work"
  export LOOPQ_SHARED="$work"
  commit="$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("commit") or "")' "$carry/MANIFEST.json" 2>/dev/null || true)"
  export LOOPQ_CARRY_COMMIT="$commit"
fi
export PYTHONPATH="$root${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
if [[ -n "$out" && ( -d "$out" || ! -e "$out" ) ]]; then  # (a file: the check says so, in one line)
  mkdir -p "$out"
  set +e
  "$python" -m loopq.gpu_check "${args[@]}" 2>&1 | tee "$out/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
exec "$python" -m loopq.gpu_check "${args[@]}"
