"""``python -m loopq.gpu_check`` / ``scripts/gpu_check.sh`` on a machine without a GPU: the no-GPU path and the
argument errors as a user meets them (subprocesses), and everything the GPU run is made of that runs on CPU - the
peak table and its arithmetic, the tables, the verdicts of each stage over fabricated outputs, the exit status, the
stage loop with fake stages, and the kernel benchmark's correctness check under Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import loopq.kernels
from loopq.artifacts.layout import STUDENT_FORMAT, STUDENT_META, STUDENT_WEIGHTS
from loopq.artifacts.seal import seal
from loopq.commands.gpu_check import checks, kernel_bench, run_checks
from loopq.commands.gpu_check.kernel_bench import KernelRow, check_row, format_rows, goal_for, summarize, worst_speedup
from loopq.commands.gpu_check.peaks import fraction, gemm_tera_ops, peaks_for, percent, weight_tb_s
from loopq.commands.gpu_check.table import (
    BELOW_GOAL,
    CUT,
    FAIL,
    OK,
    RUNNING,
    SKIPPED,
    StageResult,
    exit_status,
    format_table,
    markdown,
    markdown_table,
    verdict,
)
from loopq.errors import UsageError
from loopq.kernels import gemm_kernel, ops, quantize_kernel
from loopq.paths import REPO_ROOT
from tests.kernels.cases import ON_CUDA

H100 = peaks_for("NVIDIA H100 80GB HBM3")


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    """A command from the repository root with no GPU visible, this interpreter as ``$PYTHON``."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("LOOPQ_DEBUG", None)
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


# ------------------------------------------------------------------------------------------ as a user runs it
@pytest.mark.parametrize(
    "cmd",
    [("bash", "scripts/gpu_check.sh"), (sys.executable, "-m", "loopq.gpu_check", "--full", "--skip", "profile")],
    ids=["script", "module"],
)
def test_without_a_gpu_it_says_so_and_exits_0(cmd):
    proc = run(*cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [run_checks.NO_GPU]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--skip", "bogus"], "--skip bogus: not a stage; use some of environment, calibration"),
        (["--only", "step"], "--only step: not a stage; use some of environment, calibration"),
        (["--out", "README.md"], "--out README.md: is a file; give a directory"),
        (["--budget", "0"], "--budget 0: give a positive number of seconds"),
    ],
)
def test_a_bad_option_is_one_error_line_and_status_2(args, message):
    proc = run("bash", "scripts/gpu_check.sh", *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(f"error: {message}")


def test_bench_kernels_still_exits_0_without_a_gpu():
    proc = run(sys.executable, "bench/kernels.py", "--tokens", "1")
    assert proc.returncode == 0 and proc.stdout.startswith("no GPU:"), proc.stderr[-3000:]


# --------------------------------------------------------------------------------------------- peaks, arithmetic
@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM5"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM4"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("Tesla T4", None),
        ("NVIDIA A10G", None),  # not the A10: no row, so n/a rather than a wrong peak
    ],
)
def test_peak_lookup_by_device_name(name, model):
    peaks = peaks_for(name)
    assert (peaks.model if peaks else None) == model


def test_throughput_and_fractions_by_hand():
    # 2 * 256 * 2048 * 2048 = 2_147_483_648 operations in 10 us -> 214.75 TOPS; H100 SXM5 int8 peak 1978.9
    tops = gemm_tera_ops(256, 2048, 2048, 0.01)
    assert tops == pytest.approx(214.7483648)
    assert fraction(tops, H100.int8_tops) == pytest.approx(0.108519)
    assert percent(fraction(tops, H100.int8_tops)) == "11%"
    # 2048 x 2048 int4 weights + fp16 scales = 2_359_296 bytes in 1 us -> 2.36 TB/s = 70% of 3.35 TB/s
    assert weight_tb_s(2048, 2048, kernel_bench.INT4_WEIGHT_BYTES, 0.001) == pytest.approx(2.359296)
    assert percent(fraction(2.359296, H100.hbm_tb_s)) == "70%"
    assert fraction(1.0, None) is None and percent(None) == "n/a"


def test_goals_and_speedups():
    assert [goal_for(m) for m in (1, 16, 17, 255, 256, 4096)] == [2.5, 2.5, None, None, 1.0, 1.0]  # issue 28
    assert kernel_bench.speedup(0.03, 0.01) == pytest.approx(3.0) and kernel_bench.speedup(None, 0.01) is None


# ----------------------------------------------------------------------------------------------------- tables
RESULTS = [
    StageResult("environment", OK, "NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB", 0.21),
    StageResult("kernel-tests", OK, "212 passed, 3 skipped, 0 failed, 0 errors", 41.0),
    StageResult("kernel-bench", FAIL, "15/16 shapes exact; MISMATCH at N=2048 K=5632 M=1", 12.34),
    StageResult("calibration", SKIPPED, "--skip"),
    StageResult("profile", BELOW_GOAL, "FP fwd+bwd 80.0 ms", 100.0),
]


def test_stage_table_format():
    assert format_table(RESULTS).splitlines() == [
        "stage         status      seconds  key numbers",
        "------------  ----------  -------  -------------------------------------------------",
        "environment   ok              0.2  NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB",
        "kernel-tests  ok             41.0  212 passed, 3 skipped, 0 failed, 0 errors",
        "kernel-bench  FAIL           12.3  15/16 shapes exact; MISMATCH at N=2048 K=5632 M=1",
        "calibration   skipped         0.0  --skip",
        "profile       below goal    100.0  FP fwd+bwd 80.0 ms",
        "GPU check FAILED: kernel-bench; below goal: profile; skipped: calibration (exit status 1)",
    ]


def test_markdown_table_and_the_statuses_that_fail_the_check():
    lines = markdown_table(RESULTS[:2]).splitlines()
    assert lines[:3] == ["| stage | status | seconds | key numbers |", "|---|---|---|---|",
                         "| environment | ok | 0.2 | NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB |"]  # fmt: skip
    assert lines[-1] == "GPU check passed"
    assert markdown(["a"], [["x | y"]]).splitlines()[-1] == "| x \\| y |"
    cut = StageResult("kernel-bench", CUT, "cut at its 120 s limit; 9 rows measured")
    assert exit_status([cut]) == 1 and verdict([RESULTS[0], cut]) == "GPU check cut: kernel-bench (exit status 1)"
    assert exit_status([StageResult("e2e", RUNNING, "")]) == 1


ROWS = [
    KernelRow(
        2048, 2048, 1, bf16_ms=0.03, w4a4_quant_ms=0.004, w4a4_gemm_ms=0.01, w4a8_quant_ms=0.004, w4a8_gemm_ms=0.012
    ),
    KernelRow(
        2048, 2048, 256, bf16_ms=0.01, w4a4_quant_ms=0.005, w4a4_gemm_ms=0.008, w4a8_quant_ms=0.005, w4a8_gemm_ms=0.009
    ),
    KernelRow(2048, 5632, 16, problems=["W4A4 GEMM off by up to 1.00e-01"], max_abs_err=0.1),
]


def test_kernel_table_format():
    lines = format_rows(ROWS, H100).splitlines()
    assert lines[0].split() == [
        *("N", "K", "M", "bf16", "us", "TFLOP/s", "%bf16", "pk", "A4", "q", "us", "A4", "mm", "us", "A4", "TOPS"),
        *("%int8", "pk", "%HBM", "x", "mm", "x", "q+mm", "goal", "A8", "q", "us", "A8", "mm", "us", "%int8", "pk"),
        *("x", "mm", "x", "q+mm", "check"),
    ]
    # M=1: 2.36 TB/s of weights = 7% of HBM... in 10 us; 3.00x = 30 / 10 us; M=256: 214.7 TFLOP/s = 22% of 989.4
    assert lines[2].split() == [
        *("2048", "2048", "1", "30.0", "0.3", "0%", "4.0", "10.0", "0.8", "0%", "7%", "3.00x", "2.14x", ">=2.5x"),
        *("met", "4.0", "12.0", "0%", "2.50x", "1.88x", "exact"),
    ]
    assert lines[3].split()[3:6] == ["10.0", "214.7", "22%"] and ">=1.0x met" in lines[3]
    assert lines[4].split()[3:5] == ["-", "-"] and lines[4].endswith("W4A4 GEMM off by up to 1.00e-01")
    assert "n/a" in format_rows(ROWS[:1], None).splitlines()[2].split()  # unknown device: no fractions


def test_split_sweep_table_and_its_json_round_trip():
    """The K-split sweep: microseconds per split, the chosen split and the fastest (by hand: 4 us at split 4); a
    row without a sweep (M > 8, or untimed) is left out; the recorded JSON row (string keys) parses back into the
    same table, as the Markdown report reads it."""
    swept = KernelRow(2048, 2048, 1, split=8, split_ms={"1": 0.0097, "2": 0.006, "4": 0.004, "8": 0.0045})
    headers, cells = kernel_bench.split_table([swept, ROWS[1]])
    assert headers[-2:] == ("auto", "fastest") and cells == [
        ["2048", "2048", "1", "9.7", "6.0", "4.0", "4.5", "8", "4"]
    ]
    recorded = json.loads(json.dumps({"rows": [kernel_bench.as_dict(swept)]}))
    assert run_checks.kernel_section(recorded).endswith("| 2048 | 2048 | 1 | 9.7 | 6.0 | 4.0 | 4.5 | 8 | 4 |")
    assert kernel_bench.format_splits(ROWS) == ""


def test_warm_quantizer_table_and_its_json_round_trip():
    """The quantizer flushed against warm (by hand: 37.0 / 12.5 us = 2.96x); rows without a warm time are left out;
    the recorded JSON row gives the same table in the Markdown report, after the split sweep."""
    warm = KernelRow(2048, 5632, 1, w4a4_quant_ms=0.037, w4a4_quant_warm_ms=0.0125, split=8, split_ms={"8": 0.01})
    headers, cells = kernel_bench.warm_table([warm, ROWS[0]])
    assert headers[-1] == "flushed / warm" and cells == [["2048", "5632", "1", "37.0", "12.5", "2.96x"]]
    section = run_checks.kernel_section(json.loads(json.dumps({"rows": [kernel_bench.as_dict(warm)]})))
    assert section.endswith("| 2048 | 5632 | 1 | 37.0 | 12.5 | 2.96x |") and "| split 1 us |" in section
    assert kernel_bench.format_warm(ROWS) == ""


# ---------------------------------------------------------------------------------------- verdicts, exit status
def test_exit_status_is_1_only_when_a_stage_failed():
    assert exit_status(RESULTS) == 1
    passing = [r for r in RESULTS if r.status != FAIL]
    assert exit_status(passing) == 0
    assert verdict(passing) == "GPU check passed; below goal: profile; skipped: calibration"
    assert verdict(RESULTS[:2]) == "GPU check passed"
    with pytest.raises(ValueError, match="status='fine'"):
        StageResult("step", "fine", "")


def test_kernel_bench_verdicts():
    status, line = summarize(ROWS, H100)
    assert status == FAIL and "2/3 shapes exact; MISMATCH at N=2048 K=5632 M=16" in line
    assert "M<=16 3.00x (goal 2.5x), M>=256 1.25x (goal 1.0x)" in line and "268 TOPS = 14% of int8 peak" in line
    assert summarize(ROWS[:2], H100)[0] == OK
    small_batch = KernelRow(2048, 2048, 16, bf16_ms=0.03, w4a4_gemm_ms=0.02)  # 1.5x at M = 16: below 2.5x
    assert summarize([*ROWS[:2], small_batch], H100)[0] == BELOW_GOAL
    fast = KernelRow(2048, 2048, 256, bf16_ms=0.02, w4a4_gemm_ms=0.01)
    assert summarize([ROWS[0], fast], None)[0] == OK
    assert worst_speedup(ROWS, lambda m: m >= 256) == pytest.approx(1.25) and worst_speedup([], bool) is None


def test_kernel_tests_verdicts(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest" tests="10" failures="1" errors="0" skipped="2"/></testsuites>'
    )
    counts = checks.junit_counts(report)
    assert counts == {"tests": 10, "failures": 1, "errors": 0, "skipped": 2, "passed": 7}
    assert checks.kernel_tests_result(1, counts, "").status == FAIL
    ok = checks.kernel_tests_result(0, {**counts, "failures": 0}, "")
    assert ok.status == OK and ok.summary.startswith("7 passed, 2 skipped, 0 failed, 0 errors")
    assert checks.kernel_tests_result(0, {**counts, "failures": 0, "passed": 0}, "").status == FAIL
    assert checks.kernel_tests_result(4, None, "no tests ran").summary.endswith("(exit status 4): no tests ran")


def fake_run(root: Path, losses: list[str], student: bool = True) -> Path:
    """A ``loopq.fit`` run directory: ``train/loss`` rows in the CSV log, optionally a student."""
    (root / "csv" / "version_0").mkdir(parents=True)
    rows = ["epoch,step,train/loss,train/kl", *(f"0,{i},{v},1.0" for i, v in enumerate(losses)), "0,9,,2.0"]
    (root / "csv" / "version_0" / "metrics.csv").write_text("\n".join(rows) + "\n")
    if student:
        (root / "student").mkdir()
        (root / "student" / STUDENT_META).write_text(json.dumps(seal({"format": STUDENT_FORMAT})))
        (root / "student" / STUDENT_WEIGHTS).write_bytes(b"")
    return root


def test_calibration_verdicts(tmp_path):
    good = checks.calibration_result(0, fake_run(tmp_path / "a", ["5.25", "4.5"]), 2, "")
    assert good.status == OK and "2 steps" in good.summary and "loss 5.25 -> 4.5 (all 2 finite)" in good.summary
    assert checks.calibration_result(0, fake_run(tmp_path / "b", ["5.2", "nan"]), 2, "").status == FAIL
    assert checks.calibration_result(0, fake_run(tmp_path / "c", []), 2, "").status == FAIL
    with pytest.raises(ValueError, match="missing"):  # no student written: the stage fails with the file named
        checks.calibration_result(0, fake_run(tmp_path / "d", ["5.2"], student=False), 2, "")
    failed = checks.calibration_result(2, tmp_path, 2, "Seed set to 0\nerror: data.sources: no files\n")
    assert failed.status == FAIL and failed.summary.endswith("status 2: error: data.sources: no files")


def test_first_loss_against_the_cpu(tmp_path):
    """Step 1 on cuda against the CPU's: 5.25 vs 5.24 is 0.19 % (within 2 %), vs 5.0 is 5 % (a failure); the
    first GPU run's pair (0.027110 on the H100, 0.027316 on its CPU: 0.76 %) passes, as it must."""
    assert checks.first_loss_agrees(5.25, 5.24) and not checks.first_loss_agrees(5.25, 5.0)
    assert checks.first_loss_agrees(0.027110, 0.027316) and not checks.first_loss_agrees(5.25, 5.36)  # 2.05 %
    assert not checks.first_loss_agrees(float("nan"), 5.0) and checks.FIRST_LOSS_TOLERANCE == 0.02
    close = checks.calibration_result(0, fake_run(tmp_path / "a", ["5.25", "4.5"]), 2, "", cpu_losses=[5.24])
    assert close.status == OK and "step-1 loss cuda 5.25 vs cpu 5.24 (0.191 %, tolerance 2 %)" in close.summary
    assert close.details["cpu_first_loss"] == 5.24
    far = checks.calibration_result(0, fake_run(tmp_path / "b", ["5.25", "4.5"]), 2, "", cpu_losses=[5.0])
    assert far.status == FAIL and "(5.000 %" in far.summary
    none = checks.calibration_result(0, fake_run(tmp_path / "c", ["5.25"]), 1, "", cpu_losses=[])
    assert none.status == FAIL  # the CPU logged no loss: nothing to compare with


def test_pytest_progress_counts_the_marks_so_far():
    out = "....F.s [ 10%]\n.E..x [ 20%]\nnot a progress line\n"
    assert checks.pytest_progress(out) == {
        "passed": 8, "failures": 1, "errors": 1, "skipped": 1, "xfailed": 1, "xpassed": 0,
    }  # fmt: skip


def test_step_verdict():
    times = {"student_ms": 300.0, "compiled_student_ms": 150.0, "fp_ms": 100.0}
    result = checks.step_result(times, {"student_peak_gib": 12.34, "losses": [10.9, 10.8]}, 4)
    assert result.status == OK
    assert "4 of 24 layers" in result.summary and "W4A4 student 300.0 ms (3.00x)" in result.summary
    assert "compiled quantizers 150.0 ms (1.50x); student peak 12.3 GiB" in result.summary
    assert checks.step_result(times, {"student_peak_gib": 1.0, "losses": [float("inf")]}, 4).status == FAIL


# ------------------------------------------------------------------- the command (its driver: tests/test_gpu_driver.py)
def test_interpreted_triton_on_a_gpu_machine_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(loopq.kernels, "triton_interpreted", lambda: True)
    with pytest.raises(UsageError, match="TRITON_INTERPRET=0"):
        run_checks.main([])


# --------------------------------------------------------------------- the benchmark's check, under the interpreter
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPE = torch.bfloat16 if ON_CUDA else torch.float32  # the interpreter has no bf16


def test_chunked_reference_equals_the_kernels_float64_oracle():
    """The bench's bounded-memory reference against ``loopq.kernels.reference.gemm_fp64`` (the kernels' contract),
    here in chunks of 4 of 37 rows: the same value and bound up to float64 rounding."""
    from loopq.kernels.reference import gemm_fp64

    gen = torch.Generator().manual_seed(3)
    a = torch.randint(-8, 8, (37, 96), generator=gen, dtype=torch.int8)
    w = torch.randint(-8, 8, (64, 96), generator=gen, dtype=torch.int8)
    sa, sw = torch.rand(37, 3, generator=gen), torch.rand(64, 3, generator=gen).half()
    budget = 4 * kernel_bench.REFERENCE_TENSORS * 8 * 64
    assert kernel_bench.reference_rows(37, 64, budget) == 4
    got, got_bound = kernel_bench.gemm_fp64_chunked(a, sa, w, sw, budget)
    ref, ref_bound = gemm_fp64(a, sa, w, sw)
    assert torch.allclose(got, ref, rtol=1e-13, atol=0) and torch.allclose(got_bound, ref_bound, rtol=1e-13, atol=0)
    assert bool((got_bound > 0).all())


def test_chunked_reference_fits_its_budget_at_the_largest_shape():
    """At M = 4096, N = 11264 (fused gate+up) the unchunked reference held [64, 4096, 11264] float64 tensors (22 GiB
    each); the chunked one holds REFERENCE_TENSORS [rows, N] ones within REFERENCE_BYTES (1 GiB)."""
    rows = kernel_bench.reference_rows(4096, 11264)
    assert rows == 2**30 // (5 * 8 * 11264) == 2383 and rows * 5 * 8 * 11264 <= kernel_bench.REFERENCE_BYTES
    assert kernel_bench.reference_rows(1, 11264) == 1 and kernel_bench.reference_rows(4096, 10**12) == 1


@pytest.mark.parametrize("transform", [True, False])
def test_benchmark_check_passes_on_the_kernels(transform):
    row = check_row(64, 128, 3, DEVICE, DTYPE, transform=transform)
    assert row.problems == [] and row.max_abs_err <= 1e-5


@pytest.mark.parametrize(
    ("m", "bits", "dtype"), [(1, 4, DTYPE), (16, 8, DTYPE), (17, 4, DTYPE), (17, 8, torch.float16)]
)
def test_benchmark_times_the_kernels_the_packed_model_runs(monkeypatch, m, bits, dtype):
    """The timed GEMM is the kernel on the layout the export stores: no weight re-layout or activation unpacking per
    call (the compatibility path of ``gemm_w4a4`` re-tiles the whole weight each time), and it computes what that
    path computes on the same codes; at M > 16 the scheme ``quantized_linear`` takes for the dtype (bf16 on a GPU:
    the 16-bit one, its GEMM on the values the quantizer writes; fp16 here forced to it)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, 128, generator=gen).to(DEVICE, dtype)
    w, sw = loopq.kernels.quantize_weight(torch.randn(64, 128, generator=gen).to(DEVICE))
    left, right = kernel_bench.transform_factors(128, gen, DEVICE, True)
    prefill = "values" if dtype == torch.float16 else None
    quant, gemm = kernel_bench.timed_calls(x, left, right, w, sw, bits, dtype, prefill)
    per_call = []
    for module, name in ((ops, "tile_weight"), (kernel_bench, "tile_weight"), (ops, "deinterleave_groups")):
        monkeypatch.setattr(module, name, lambda *a, name=name: per_call.append(name))
    monkeypatch.setattr(ops.reference, "unpack_int4", lambda *a: per_call.append("unpack_int4"))
    got = gemm()
    quant()
    assert per_call == []
    monkeypatch.undo()
    if m > 16 and ops.prefill_scheme(dtype, prefill) == "values":
        values, _ = quantize_kernel.quantize_activation(
            x, left, right, kernel_bench.CLIP, bits, 32, None, None, False, None, dtype
        )
        expected = gemm_kernel.gemm_values(values, w, sw.half(), dtype)
    else:
        a, sa = loopq.kernels.quantize_activation(x, left, right, kernel_bench.CLIP, bits, backend="triton")
        expected = dict(kernel_bench.GEMMS)[bits](a, sa, w, sw, dtype, backend="triton")
    assert torch.equal(got, expected)


def test_benchmark_check_catches_a_wrong_kernel(monkeypatch):
    wrong_gemm = ops._GEMM_W4A4["triton"]
    monkeypatch.setitem(ops._GEMM_W4A4, "triton", lambda *args: wrong_gemm(*args) + 0.01)
    wrong_quant = ops._QUANTIZE["triton"]
    monkeypatch.setitem(ops._QUANTIZE, "triton", lambda *args: (lambda c, s: (c, 2 * s))(*wrong_quant(*args)))
    row = check_row(64, 128, 3, DEVICE, DTYPE)
    assert row.problems == [
        "W4A4 quantizer not bit-exact",
        "W4A4 GEMM off by up to 1.00e-02",
        "W4A8 quantizer not bit-exact",
    ]
    assert summarize([row], None)[0] == FAIL


def test_benchmark_checks_the_values_scheme_on_16_bit_inputs(monkeypatch):
    """A 16-bit row also checks the 16-bit prefill scheme (the one bf16 prefill times): exact on the kernels, and a
    values GEMM off by 1e-2 or a values quantizer off in one value is reported, not timed as if correct."""
    row = check_row(64, 128, 3, DEVICE, torch.float16)
    assert row.problems == [] and row.max_abs_err <= 1e-5
    wrong_gemm = gemm_kernel.gemm_values
    monkeypatch.setattr(gemm_kernel, "gemm_values", lambda *args: wrong_gemm(*args) + 0.01)
    assert check_row(64, 128, 3, DEVICE, torch.float16).problems == [
        "W4A4 values GEMM off by up to 1.00e-02",
        "W4A8 values GEMM off by up to 1.00e-02",
    ]
    monkeypatch.undo()
    wrong_quant = quantize_kernel.quantize_activation

    def one_value_off(*args: object) -> tuple:
        values, scales = wrong_quant(*args)
        values.view(-1)[0] += 1
        return values, scales

    monkeypatch.setattr(quantize_kernel, "quantize_activation", one_value_off)
    problems = check_row(64, 128, 3, DEVICE, torch.float16).problems
    assert problems[0] == "W4A4 values quantizer not bit-exact" and "W4A8 values quantizer not bit-exact" in problems


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_step_trains_the_students_quantization_parameters_only():
    """The timed step on a tiny Ouro (on CPU, where the cuda autocast is a no-op): a finite loss, gradients reach the
    student's quantization parameters during backward, and none are kept afterwards."""
    config = checks.OuroConfig(64, 64, 96, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    student = checks.prepare(checks.OuroLM.from_config(config, seed=0), checks.STUDENT)
    seen = []
    for p in student.parameters():
        if p.requires_grad:
            p.register_hook(lambda grad: seen.append(bool(grad.abs().sum() > 0)) or grad)
    losses: list[float] = []
    checks.train_step(student, torch.randint(0, 64, (2, 16)), losses)()
    assert len(losses) == 1 and losses[0] == pytest.approx(torch.log(torch.tensor(64.0)).item(), rel=0.2)
    assert seen and any(seen) and all(p.grad is None for p in student.parameters())


def test_profile_of_a_step_counts_its_time():
    """The ``step`` stage profiles one student step (where a 4x step goes); on the CPU it profiles CPU ops."""
    x = torch.randn(64, 64, requires_grad=True)
    profile = checks.profile_step(lambda: (x @ x).sum().backward(), rows=5)
    assert "aten::mm" in profile["top_ops"] and profile["cpu_ms"] > 0
    assert profile["kernel_launches"] == 0 and profile["cuda_ms"] == 0  # no CUDA here


def test_e2e_verdict_names_the_integer_prefill_kernel_beside_the_default():
    """bench/e2e.py's ``W4A4 int8`` prefill row (the integer kernel, the default being bf16's 16-bit scheme) is
    reported beside W4A4's, 600 / 1000 = 0.60x; the verdict still reads the default's 0.90x against the goal."""
    payload = {
        "batches": [1],
        "modes": ["graphs"],
        "prefill": {"BF16": {"prefill tok/s": 1000.0}, "W4A4": {"prefill tok/s": 900.0}},
        "decode": {"BF16": {"b1 graphs ms/tok": 2.0}, "W4A4": {"b1 graphs ms/tok": 1.0}},
    }
    payload["prefill"]["W4A4 int8"] = {"prefill tok/s": 600.0}
    result = checks.e2e_result(payload)
    assert "prefill W4A4 0.90x; (int8 prefill kernel 0.60x)" in result.summary and result.status == BELOW_GOAL


def test_e2e_verdict_reads_the_fastest_mode_and_the_goals():
    """Fabricated bench/e2e.py numbers: W4A4 decode at batch 1 is 20/8 = 2.5x BF16 in its fastest mode (graphs),
    batch 16 30/20 = 1.5x (below 2x); prefill 1.2x; BF16's fastest batch-1 step 20 ms over a 5 ms bound = 4x."""
    payload = {
        "batches": [1, 16],
        "modes": ["cache", "graphs"],
        "prefill": {"BF16": {"prefill tok/s": 1000.0}, "W4A4": {"prefill tok/s": 1200.0}},
        "decode": {
            "BF16": {
                "b1 cache ms/tok": 40.0,
                "b1 graphs ms/tok": 20.0,
                "b16 cache ms/tok": 60.0,
                "b16 graphs ms/tok": 2.0,
            },
            "W4A4": {
                "b1 cache ms/tok": 30.0,
                "b1 graphs ms/tok": 8.0,
                "b16 cache ms/tok": 40.0,
                "b16 graphs ms/tok": 45.0,
            },
        },
        "bound_ms": 5.0,
    }
    result = checks.e2e_result(payload)
    assert result.status == BELOW_GOAL
    assert result.summary.startswith("decode b1 W4A4 2.50x bf16 (graphs); decode b16 W4A4 1.50x bf16 (cache)")
    assert (
        "prefill W4A4 1.20x" in result.summary and "BF16 b1 step 20.00 ms = 4.0x its bandwidth bound" in result.summary
    )
    payload["decode"]["W4A4"]["b16 cache ms/tok"] = 25.0  # 60 / 25 = 2.4x
    payload["bound_ms"] = 10.0  # 20 / 10 = 2x
    assert checks.e2e_result(payload).status == OK
    payload["prefill"]["W4A4"]["prefill tok/s"] = 900.0
    assert checks.e2e_result(payload).status == BELOW_GOAL


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "load"]], ids=["one-process", "xdist"])
def test_kernel_tests_stage_names_failures_as_they_happen(tmp_path, workers):
    """The plugin the ``kernel-tests`` stage loads writes each failure when it happens (a cut stage still names what
    failed): one failing assertion and one erroring fixture among passing tests, read back with their messages -
    once each under xdist too (the controller writes, the workers do not), and the progress parser counts them."""
    from loopq.commands.gpu_check import pytest_failures
    from loopq.commands.gpu_check.checks import name_of

    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok():\n    assert True\n"
        "def test_wrong():\n    assert 1 + 1 == 3, 'arithmetic'\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('no device')\n"
        "def test_error(broken):\n    pass\n"
        "def test_expected():\n    pytest.xfail('known on this device')\n"
    )
    out = tmp_path / "failures.jsonl"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", pytest_failures.__name__]
    env = {**os.environ, pytest_failures.ENV: str(out), "PYTHONPATH": str(REPO_ROOT)}
    cmd += [*workers, "-p", "no:randomly"]
    run = subprocess.run([*cmd, str(tmp_path / "test_sample.py")], cwd=tmp_path, env=env, capture_output=True)
    assert run.returncode == 1
    rows = sorted(pytest_failures.read_failures(out), key=lambda r: ["call", "setup", "xfail"].index(r["when"]))
    assert [(name_of(r["test"]), r["when"]) for r in rows] == [
        ("test_sample::test_wrong", "call"),
        ("test_sample::test_error", "setup"),
        ("test_sample::test_expected", "xfail"),
    ]
    progress = checks.pytest_progress(run.stdout.decode())
    assert (progress["passed"], progress["failures"], progress["errors"], progress["xfailed"]) == (1, 1, 1, 1)
    assert "arithmetic" in rows[0]["error"] and "no device" in rows[1]["error"]
    assert rows[2]["error"] == "known on this device"
    assert pytest_failures.read_failures(tmp_path / "absent.jsonl") == []


def test_kernel_tests_run_on_half_the_cores_with_xdist():
    assert checks.xdist_args(16, True) == ["-n", "8", "--dist", "load"]
    assert checks.xdist_args(64, True) == ["-n", "8", "--dist", "load"]  # at most 8 CUDA contexts
    assert checks.xdist_args(6, True) == ["-n", "3", "--dist", "load"]
    assert checks.xdist_args(2, True) == [] and checks.xdist_args(16, False) == []


def test_the_run_records_the_carrys_commit_and_what_git_says_there():
    """A device machine's copy of the tree came with a stale git history: the carry's commit is the run's, git's is
    kept beside it when it differs; without a carry git's is the only one."""
    assert run_checks.commits("d5eb442+dirty", "854d779") == {"commit": "854d779", "git_there": "d5eb442+dirty"}
    assert run_checks.commits("854d779", "854d779") == {"commit": "854d779"}
    assert run_checks.commits("854d779", None) == {"commit": "854d779"}
    assert run_checks.commits(None, None) == {"commit": None}
