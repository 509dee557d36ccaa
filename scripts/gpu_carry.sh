#!/usr/bin/env bash
# Builds .gpu-carry/ (git-ignored): what the GPU check needs on a bare GPU machine with no network, beyond that
# machine's image (loopq/commands/gpu_check/gpu_image.txt) - run here, where PyPI is reachable:
#
#   scripts/gpu_carry.sh            # then, on the GPU machine, from the checkout with .gpu-carry beside it:
#   scripts/gpu_check.sh --carry .gpu-carry --out OUT_DIR
#
# .gpu-carry/wheels: cp312 manylinux wheels of the nine packages the check's stages import that the image lacks
#   (loopq.commands.gpu_check.carry.CARRIED, at the pins of constraints.txt); deepspeed, published as source only, is
#   built here into a pure-Python wheel (DS_BUILD_OPS=0).
# .gpu-carry/data.tar.xz: the slices of the shared data the stages read (carry.DATA), from LOOPQ_SHARED / ../shared.
# .gpu-carry/MANIFEST.json: the commit, sizes and SHA-256 of the files.
# It ends with the size of the tree plus the carry, and fails beyond 60 MiB (a device call takes 64 MiB in all).
set -euo pipefail
usage() { sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; }  # the comment block above
case "${1:-}" in
  "") ;;
  -h|--help) usage; exit 0 ;;
  *) echo "error: scripts/gpu_carry.sh takes no arguments, got $1 (-h for help)" >&2; exit 2 ;;
esac
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python="python3"; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
out="$root/.gpu-carry"
tmp="$root/.gpu-carry.partial"
rm -rf "$tmp"
mkdir -p "$tmp/wheels"
mapfile -t pins < <("$python" -m loopq.commands.gpu_check.carry pins)
for pin in "${pins[@]}"; do
  # a published cp312 manylinux (or pure-Python) wheel; else (deepspeed: source only) a wheel built here
  if ! "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$tmp/wheels" "$pin" >/dev/null 2>&1; then
    DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps "$pin" -w "$tmp/wheels" >/dev/null 2>&1 \
      || { echo "error: could not download or build a wheel of $pin (is PyPI reachable?)" >&2; exit 1; }
  fi
done
"$python" -m loopq.commands.gpu_check.carry data --out "$tmp"
rm -rf "$out"
mv "$tmp" "$out"
echo "built $out: $(ls "$out/wheels" | wc -l) wheels, data.tar.xz $(du -k "$out/data.tar.xz" | cut -f1) KiB"
"$python" -m loopq.commands.gpu_check.carry size "$out"
