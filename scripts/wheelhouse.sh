#!/usr/bin/env bash
# Wheels of LoopQ and of every dependency except torch and triton, for a GPU node without internet that already has
# its own CUDA build of torch (and the triton that came with it):
#
#   scripts/wheelhouse.sh [--python 3.12] [--platform TAG ...] [--out wheelhouse]   # on a machine with PyPI
#   # copy wheelhouse/ to the node, then there (torch already installed):
#   pip install --no-index --find-links wheelhouse loopq            # or: pip install --no-index --find-links wheelhouse -e .
#
# What it downloads is constraints.txt (the tested versions) minus torch and triton, as binary wheels for the
# target Python and platform (--no-deps: the list is already complete). deepspeed is published as a source
# distribution only: it is built here into a pure-Python wheel (DS_BUILD_OPS=0: its ops JIT-compile on the node
# when used). On the node, pip keeps every package it already has in a compatible version and installs the rest
# from the folder: torch and triton are never replaced (pyproject.toml accepts torch 2.11-2.13, triton 3.6-3.9).
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=3.12
platforms=()  # default: x86_64 Linux with glibc >= 2.28 (newer wheels are tagged manylinux_2_28, older 2014/2_17)
out=wheelhouse
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python_version="$2"; shift 2 ;;
    --platform) platforms+=("$2"); shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "error: unknown option $1 (use --python, --platform, --out)" >&2; exit 2 ;;
  esac
done
[ ${#platforms[@]} -gt 0 ] || platforms=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
platform_args=()
for p in "${platforms[@]}"; do platform_args+=(--platform "$p"); done
mkdir -p "$out"
list="$(mktemp)"
trap 'rm -f "$list"' EXIT
# the tested pins, without torch/triton (the node's own)
grep -E '^[A-Za-z0-9_.-]+==' constraints.txt | grep -viE '^(torch|triton)==' > "$list"
built=()
while read -r pin; do
  # a binary wheel for the target when one is published; else (deepspeed, rouge_score, ...: source only) a wheel
  # built here, which is pure Python for all of them (DS_BUILD_OPS=0: deepspeed's ops JIT-compile on the node)
  if ! pip download --no-deps --only-binary=:all: --python-version "$python_version" "${platform_args[@]}" \
      --implementation cp -d "$out" "$pin" >/dev/null 2>&1; then
    DS_BUILD_OPS=0 pip wheel --no-deps "$pin" -w "$out" >/dev/null
    built+=("$pin")
  fi
done < "$list"
pip download --no-deps --only-binary=:all: -d "$out" "setuptools>=69" wheel >/dev/null  # to build LoopQ there
pip wheel --no-deps . -w "$out" >/dev/null
for wheel in "$out"/*.whl; do
  case "$wheel" in *-none-any.whl|*-cp"${python_version/./}"-*|*-abi3-*) ;; *) echo "warning: $wheel is not for cp${python_version/./}" >&2 ;; esac
done
echo "built from source: ${built[*]:-none}"
echo "wheelhouse: $(ls "$out" | wc -l) wheels in $out for cp${python_version/./} ${platforms[*]}"
