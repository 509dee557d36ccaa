"""The GPU check's carry (scripts/gpu_carry.sh, loopq.commands.gpu_check.carry) on the CPU: every module the check's
stages import resolves from the recorded GPU image or the carry; the carried data slices are enough for what the
stages read; and, once the carry is built (``scripts/gpu_carry.sh``; the tests that need it skip otherwise), it
fits the device call with the tree and installs offline, as cp312, into an empty target folder."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
from importlib.metadata import distributions

import pytest
import yaml
from packaging.requirements import Requirement

from loopq.commands.gpu_check import carry
from loopq.commands.gpu_check.flow import PIPELINE_WINDOWS
from loopq.paths import ASSETS, REPO_ROOT, data_dir, fixtures_dir

BUILT = (carry.CARRY_DIR / "wheels").is_dir() and (carry.CARRY_DIR / "data.tar.xz").is_file()
needs_carry = pytest.mark.skipif(not BUILT, reason="no .gpu-carry: build it with scripts/gpu_carry.sh")

#: what the stages' processes import: the driver and stages, the commands they run (fit with the DeepSpeed strategy
#: of the paper config, evaluate, export, generate), pytest with the kernel tests, and bench/e2e.py
STAGE_IMPORTS = (
    "loopq.commands.gpu_check.run_checks",
    "loopq.commands.gpu_check.checks",
    "loopq.commands.fit",
    "loopq.commands.evaluate",
    "loopq.commands.export",
    "loopq.commands.generate",
    "loopq.calib.deepspeed",
    "deepspeed",
    "lightning.pytorch.cli",
    "pytest",
    "tests.conftest",
    *(f"tests.kernels.{p.stem}" for p in sorted((REPO_ROOT / "tests" / "kernels").glob("*.py"))),
)
#: imported here from packages this venv has that the image does not, by packages the image has in its own
#: versions: torch imports dill when it is installed; this venv's huggingface_hub imports its HTTP stack
#: (httpx2, httpcore2, truststore), the image's huggingface-hub 1.33.0 comes with its own (httpx, httpcore)
NOT_NEEDED_THERE = {"dill", "httpx2", "httpcore2", "truststore"}
#: environment markers of the GPU image's Python (for the requirements of the carried wheels)
IMAGE_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
LOCAL = {"loopq", "tests", "generate", "e2e_bench"}  # this checkout (bench/generate.py imported by bench/e2e.py)

PROBE = """
import importlib, importlib.util, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
sys.path.insert(0, "bench")
spec = importlib.util.spec_from_file_location("e2e_bench", "bench/e2e.py")
spec.loader.exec_module(importlib.util.module_from_spec(spec))
from importlib.metadata import packages_distributions
found = packages_distributions()
tops = sorted({n.split(".")[0] for n in sys.modules} - set(sys.stdlib_module_names))
print(json.dumps({t: found.get(t) for t in tops}))
"""


def test_every_module_the_stages_import_is_in_the_image_or_the_carry():
    env = {"PYTHONPATH": str(REPO_ROOT), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *STAGE_IMPORTS], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    available = set(carry.read_image()) | set(carry.CARRIED)
    unresolved = {}
    for module, dists in modules.items():
        if module in LOCAL or (dists is None and (module.startswith("_") or module == "cython_runtime")):
            continue
        names = {carry.canonical(d) for d in dists or []}
        if not names or not names & (available | NOT_NEEDED_THERE):
            unresolved[module] = dists
    assert unresolved == {}
    carried_used = {carry.canonical(d) for dists in modules.values() for d in dists or []} & set(carry.CARRIED)
    assert carried_used == set(carry.CARRIED)  # nothing carried that the stages do not import


def test_the_carried_packages_are_exactly_what_the_image_lacks():
    image = carry.read_image()
    assert not set(carry.CARRIED) & set(image)
    assert image["torch"] == "2.11.0" and image["triton"] == "3.6.0" and image["python"] == "3.12.3"
    pins = carry.pins()
    assert [carry.canonical(p.split("==")[0]) for p in pins] == list(carry.CARRIED)
    assert "deepspeed==0.19.8" in pins


def test_head_keeps_whole_lines():
    assert carry.head(b"ab\ncd\nef\n", 7) == b"ab\ncd\n"
    assert carry.head(b"ab\ncd\n", 100) == b"ab\ncd\n" and carry.head(b"abcdef", 3) == b"abc"
    assert carry.head(b"ab\ncd\n", None) == b"ab\ncd\n"


def test_carried_data_is_enough_for_the_stages(tmp_path, monkeypatch):
    """The slices hold what the stages read: ``configs/tiny.yaml``'s whole ``data`` section as the calibration stage
    runs it (read from the config, so a source the config gains is checked: the first GPU run of this check failed
    on the validation set's WikiText-2 valid text, which the carry lacked), the paper-shape stage's 64 + 8 windows
    of 256 SmolLM2 tokens, and the pipeline's WikiText-2 windows."""
    from loopq.data.calibration import CalibrationDataModule, calibration_stream, check_enough_tokens
    from loopq.data.tokenizer import load_tokenizer
    from loopq.metrics.perplexity import wikitext2_stream

    with tarfile.open(fileobj=io.BytesIO(carry.data_archive(data_dir())), mode="r:xz") as tar:
        tar.extractall(tmp_path, filter="data")
    root = tmp_path / "data"
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == sorted(r for r, _ in carry.DATA)
    config = yaml.safe_load((REPO_ROOT / "configs" / "tiny.yaml").read_text())
    teacher = str(REPO_ROOT / config["model"]["teacher"])
    tiny = CalibrationDataModule(tokenizer=teacher, root=str(root), **config["data"])
    tiny.setup("fit")  # every source and validation source read, enough tokens for every window
    assert len(tiny.samples) == config["data"]["num_samples"] and set(tiny.val_sets) == {"heldout", "extra"}
    smollm2 = root / "tokenizers" / "smollm2" / "SmolLM2-135M-Instruct-Tokenizer.json"
    check_enough_tokens(calibration_stream(str(smollm2), None, str(root)).numel(), 64, 8, 256)  # paper-shape
    monkeypatch.setenv("LOOPQ_DATA", str(root))
    assert len(wikitext2_stream(load_tokenizer(ASSETS / "tiny-ouro"))) >= PIPELINE_WINDOWS * 256


def test_carried_fixtures_are_the_ones_the_kernel_tests_read(tmp_path):
    """Every shared fixture a kernel test names (``fixtures / "<name>"``) is carried whole, byte for byte, under the
    archive's ``fixtures/`` (the second GPU check of session 25 errored on ``test_decode_launches``, whose tiny Ouro
    the carry lacked); the kernel tests' ``fixtures`` fixture then finds it at ``LOOPQ_SHARED/fixtures``."""
    named = set()
    for path in (REPO_ROOT / "tests" / "kernels").glob("*.py"):
        named |= set(re.findall(r'fixtures\s*/\s*"([^"]+)"', path.read_text()))
    assert named and named <= set(carry.FIXTURES), sorted(named - set(carry.FIXTURES))
    with tarfile.open(fileobj=io.BytesIO(carry.data_archive(data_dir(), fixtures_dir())), mode="r:xz") as tar:
        tar.extractall(tmp_path, filter="data")
    for name in carry.FIXTURES:
        source = sorted(p.relative_to(fixtures_dir()) for p in (fixtures_dir() / name).rglob("*") if p.is_file())
        got = sorted(p.relative_to(tmp_path / "fixtures") for p in (tmp_path / "fixtures" / name).rglob("*"))
        assert got == source
        assert all((tmp_path / "fixtures" / p).read_bytes() == (fixtures_dir() / p).read_bytes() for p in source)


@needs_carry
def test_tree_plus_carry_fits_the_device_call():
    total = carry.tree_bytes() + carry.carry_bytes(carry.CARRY_DIR)
    assert total <= carry.LIMIT_BYTES, f"{total / 2**20:.1f} MiB"
    manifest = json.loads((carry.CARRY_DIR / "MANIFEST.json").read_text())
    for name, entry in manifest["files"].items():
        assert carry.sha256(carry.CARRY_DIR / name) == entry["sha256"], name


@needs_carry
def test_carry_installs_offline_into_an_empty_target(tmp_path):
    """``pip install --no-index --no-deps --target`` of the wheels as the GPU machine's cp312 does it: every carried
    distribution lands with its pinned version, and what each requires (jsonargparse with its ``signatures`` extra,
    which Lightning checks) is in the image or the carry."""
    target = tmp_path / "site"
    wheels = sorted(str(p) for p in (carry.CARRY_DIR / "wheels").glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    cmd += [str(target), "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
    cmd += [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    proc = subprocess.run([*cmd, *wheels], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    installed = {carry.canonical(d.metadata["Name"]): d for d in distributions(path=[str(target)])}
    pinned = dict(p.split("==") for p in carry.pins())
    assert {name: d.version for name, d in installed.items()} == {carry.canonical(k): v for k, v in pinned.items()}
    available = set(carry.read_image()) | set(carry.CARRIED)
    for name, dist in installed.items():
        for files in dist.files or []:
            assert (target / files).exists() or str(files).startswith(".."), f"{name}: {files} not installed"
        for line in dist.requires or []:
            req = Requirement(line)
            extra = "signatures" if name == "jsonargparse" else ""  # what Lightning checks
            if req.marker is not None and not req.marker.evaluate({**IMAGE_MARKERS, "extra": extra}):
                continue
            assert carry.canonical(req.name) in available, f"{name} requires {line}: in neither the image nor the carry"
    assert (target / "pydantic_core").is_dir() and any((target / "pydantic_core").glob("*cpython-312-x86_64*.so"))


def test_no_stage_reads_what_may_stay_behind():
    """The folders ``size`` may tell a user to move out of the checkout for a device call are named by none of the
    check's code, kernel tests, scripts or the config its stages run."""
    sources = [
        *(REPO_ROOT / "loopq" / "commands" / "gpu_check").rglob("*.py"),
        *(REPO_ROOT / "tests" / "kernels").rglob("*.py"),
    ]
    sources += [
        REPO_ROOT / "scripts" / "gpu_check.sh",
        REPO_ROOT / "configs" / "tiny.yaml",
        REPO_ROOT / "configs" / "ouro2.6b.yaml",
    ]
    names = [folder.rsplit("/", 1)[1] for folder in carry.STAY_BEHIND]
    for path in sources:
        text = path.read_text()
        assert not [n for n in names if n in text and path.name != "carry.py"], path
    assert carry.tree_bytes(without=carry.STAY_BEHIND) < carry.tree_bytes() - 30 * 2**20  # 35 MiB of teachers
