"""What the GPU check brings to a bare GPU machine with no network (``scripts/gpu_carry.sh`` builds it here).

A device call takes the repository's tree plus at most 64 MiB in all, so the carry is the least the check's stages
need beyond the machine's image (:data:`IMAGE_LIST`, recorded there):

* ``wheels/``: cp312 wheels of the :data:`CARRIED` distributions, the only ones the stages import that the image
  lacks: ``jsonargparse[signatures]`` (with ``docstring_parser`` and ``typeshed_client``), the parser of every
  command (:mod:`loopq.commands.cli`), the check's own driver and stage runner included, and DeepSpeed (with
  ``hjson`` and pydantic 2) for the paper config's ``LoopQDeepSpeedStrategy``. Their versions are the tested pins
  of ``constraints.txt``. Installed there offline into a target directory (``pip install --no-index --no-deps
  --target``), as wheels, since Lightning reads DeepSpeed's and jsonargparse's installed metadata.
* ``data.tar.xz``: the slices of the shared data the stages read (:data:`DATA`): the start of each calibration text
  (``calibration``, ``paper-shape``), the start of WikiText-2's test text (``pipeline`` reads its first
  ``PIPELINE_WINDOWS`` windows) and of its valid text (``configs/tiny.yaml``'s validation set, ``calibration``) and
  the SmolLM2 tokenizer (``paper-shape``), and the :data:`FIXTURES` the kernel tests read, unpacked there into the
  folder ``LOOPQ_SHARED`` points at.
* ``MANIFEST.json``: the commit it was built from, each file's size and SHA-256.

``python -m loopq.commands.gpu_check.carry pins`` prints the pins, ``data --out DIR`` writes the data and the
manifest, ``size DIR`` prints the tree + carry size against :data:`LIMIT_BYTES`.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from loopq.commands.cli import Command
from loopq.errors import UsageError, run_cli
from loopq.files import atomic_write
from loopq.paths import REPO_ROOT, data_dir, fixtures_dir

IMAGE_LIST = Path(__file__).with_name("gpu_image.txt")
CONSTRAINTS = REPO_ROOT / "constraints.txt"
#: distributions the stages import that the GPU image lacks (PEP 503 names)
CARRIED = (
    "jsonargparse",
    "docstring-parser",
    "typeshed-client",
    "deepspeed",
    "hjson",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
)
#: the carry's folder, git-ignored (``.gitignore``), named in the device call's ``carry``
CARRY_DIR = REPO_ROOT / ".gpu-carry"
#: the device call's limit is 64 MiB; 4 MiB stay free for files added between building the carry and the call
LIMIT_BYTES = 60 * 2**20
#: tracked folders no stage reads (the two small-ouro teachers, 35 MiB of the tree): when the tree outgrows the limit,
#: ``size`` says to move them out of the checkout for the device call (a test keeps the stages from naming them)
STAY_BEHIND = ("loopq/assets/small-ouro", "loopq/assets/small-ouro-sensitive")
#: the shared data the stages read, relative to the data folder: (path, bytes kept from its start, None: whole file)
DATA: tuple[tuple[str, int | None], ...] = (
    ("calibration/debian-handbook-en.txt", 64 * 1024),
    ("calibration/simplebooks-92-valid.txt", 64 * 1024),
    ("calibration/tinyshakespeare_input.txt", 64 * 1024),
    ("wikitext2/wiki.test.raw", 64 * 1024),
    ("wikitext2/wiki.valid.tokens", 64 * 1024),  # configs/tiny.yaml's data.val_sources (the calibration stage)
    ("tokenizers/smollm2/SmolLM2-135M-Instruct-Tokenizer.json", None),
)
#: the shared fixtures the ``kernel-tests`` stage reads (``tests/kernels``: the tiny Ouro of the decode-launch count),
#: carried whole under ``fixtures/`` beside ``data/``
FIXTURES: tuple[str, ...] = ("ouro-tiny",)


def canonical(name: str) -> str:
    """A distribution's PEP 503 name: lowercase, runs of ``-``, ``_``, ``.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_image(path: Path = IMAGE_LIST) -> dict[str, str | None]:
    """The recorded image: canonical name -> version (None where only the name was recorded)."""
    image: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split()
            image[canonical(name)] = None if version == "-" else version
    return image


def pins(constraints: Path = CONSTRAINTS) -> list[str]:
    """``name==version`` of every :data:`CARRIED` distribution, from ``constraints.txt`` (one error names a missing
    pin)."""
    found = {}
    for line in constraints.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if match and canonical(match.group(1)) in CARRIED:
            found[canonical(match.group(1))] = f"{match.group(1)}=={match.group(2)}"
    missing = [name for name in CARRIED if name not in found]
    if missing:
        raise UsageError(f"{constraints}: no pin for {', '.join(missing)}; add name==version lines for them")
    return [found[name] for name in CARRIED]


def head(data: bytes, limit: int | None) -> bytes:
    """The first ``limit`` bytes of ``data`` cut after its last newline within them (all of it for None or when it
    is shorter), so no line is cut in half."""
    if limit is None or len(data) <= limit:
        return data
    cut = data.rfind(b"\n", 0, limit)
    return data[: cut + 1] if cut >= 0 else data[:limit]


def data_archive(source: Path, fixtures: Path | None = None) -> bytes:
    """The :data:`DATA` slices of ``source`` (a data folder) as an xz tar under ``data/`` and, given ``fixtures``
    (the shared fixtures folder), the :data:`FIXTURES` folders whole under ``fixtures/`` (so that the archive's root
    is a ``LOOPQ_SHARED``); deterministic: fixed order, times and owners."""
    entries = [(source / relative, f"data/{relative}", limit) for relative, limit in DATA]
    for name in FIXTURES if fixtures is not None else ():
        folder = fixtures / name
        if not folder.is_dir():
            raise UsageError(f"{folder}: not found; set LOOPQ_SHARED to the shared folder")
        entries += [(p, f"fixtures/{p.relative_to(fixtures)}", None) for p in sorted(folder.rglob("*")) if p.is_file()]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=9) as tar:
        for path, name, limit in entries:
            if not path.is_file():
                raise UsageError(f"{path}: not found; set LOOPQ_SHARED (or LOOPQ_DATA) to the shared data")
            payload = head(path.read_bytes(), limit)
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(payload), 0o644
            tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def commit() -> str | None:
    """The checkout's commit (``+dirty`` when tracked files changed), None outside a git checkout."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=REPO_ROOT, capture_output=True, text=True)
    except OSError:
        return None
    if rev.returncode != 0:
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def tree_bytes(root: Path = REPO_ROOT, without: tuple[str, ...] = ()) -> int:
    """Bytes of what a device call sends besides the carry: tracked files and untracked ones git does not ignore
    (``without``: less the files under these folders)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    )
    names = [name for name in listed.stdout.decode().split("\0") if name]
    files = {root / name for name in names if not any(name.startswith(f"{folder}/") for folder in without)}
    return sum(path.stat().st_size for path in files if path.is_file() and not path.is_symlink())


def carry_bytes(carry: Path) -> int:
    return sum(path.stat().st_size for path in carry.rglob("*") if path.is_file())


def write_manifest(carry: Path) -> dict[str, object]:
    """``MANIFEST.json`` of a built carry: the commit, each file's size and SHA-256, and the total."""
    files = sorted(p for p in carry.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    manifest = {
        "commit": commit(),
        "files": {str(p.relative_to(carry)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files},
        "bytes": sum(p.stat().st_size for p in files),
    }
    atomic_write(carry / "MANIFEST.json", lambda tmp: tmp.write_text(json.dumps(manifest, indent=1) + "\n"))
    return manifest


def pins_command() -> int:
    """Print name==version of the carried wheels."""
    print("\n".join(pins()))
    return 0


def data(out: Path = CARRY_DIR) -> int:
    """Write OUT/data.tar.xz and OUT/MANIFEST.json.

    Args:
        out: the carry folder to write them into
    """
    archive = data_archive(data_dir(), fixtures_dir())
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "data.tar.xz", lambda tmp: tmp.write_bytes(archive))
    write_manifest(out)
    return 0


def size(carry: Path) -> int:
    """Print the tree + carry bytes against the limit; exit status 1 beyond it.

    Args:
        carry: the carry folder
    """
    tree, carried, lean = tree_bytes(), carry_bytes(carry), tree_bytes(without=STAY_BEHIND)
    mib = 2**20
    print(
        f"tree {tree / mib:.1f} MiB + carry {carried / mib:.1f} MiB = {(tree + carried) / mib:.1f} MiB "
        f"(limit {LIMIT_BYTES / mib:.0f} MiB; {(lean + carried) / mib:.1f} MiB without {', '.join(STAY_BEHIND)})"
    )
    if tree + carried <= LIMIT_BYTES:
        return 0
    if lean + carried <= LIMIT_BYTES:  # no stage reads them: they can stay on this machine during the call
        print(f"over the limit: for the device call, mkdir -p ../stay-behind && mv {' '.join(STAY_BEHIND)} "
              f"../stay-behind/; afterwards mv ../stay-behind/* loopq/assets/")  # fmt: skip
    return 1


SUBCOMMANDS = {"pins": pins_command, "data": data, "size": size}
COMMAND = Command(SUBCOMMANDS, "loopq.commands.gpu_check.carry", __doc__, positional=True)

build_parser, main = COMMAND.parser, COMMAND.run


if __name__ == "__main__":
    run_cli(lambda: sys.exit(main()))
