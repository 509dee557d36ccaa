"""Fake GPU-check stages for tests/test_gpu_driver.py: the real stages' names and order, each stage's GPU part
replaced by a behaviour chosen per test through ``LOOPQ_FAKE_STAGES`` (JSON ``{stage: behaviour}``; default ``ok``):

* ``ok``: records one row, returns ``ok``; ``fail``: returns ``FAIL``;
* ``slow``: records a row every 0.1 s (``rows``: ``[1]``, ``[1, 2]``, ...) and never ends by itself;
* ``crash``: records a row, then raises; ``die``: records a row, then the process exits with status 3.

Each stage appends ``name pid seconds-left quick`` to the file ``LOOPQ_FAKE_LOG`` first. Run by the real driver in
its own process (``python -m loopq.commands.gpu_check.stage tests.gpu_fakes NAME ...``); no torch, no GPU."""

from __future__ import annotations

import json
import os
import time
from functools import partial

from loopq.commands.gpu_check.driver import Limits
from loopq.commands.gpu_check.stage import Context
from loopq.commands.gpu_check.table import FAIL, OK, StageResult

NEEDS_CUDA = False
NAMES = ("environment", "calibration", "kernel-tests", "kernel-bench", "e2e", "pipeline", "paper-shape", "profile")


def behaviour(name: str) -> str:
    return json.loads(os.environ.get("LOOPQ_FAKE_STAGES", "{}")).get(name, "ok")


def fake(name: str, ctx: Context) -> StageResult:
    with open(os.environ["LOOPQ_FAKE_LOG"], "a") as log:
        log.write(f"{name} {os.getpid()} {ctx.remaining(0):.2f} {ctx.quick}\n")
    what = behaviour(name)
    if what == "slow":
        rows: list[int] = []
        while True:
            rows.append(len(rows) + 1)
            ctx.record(f"{len(rows)} rows", rows=list(rows))
            time.sleep(0.1)
    ctx.record(f"{name} measured", rows=[1])
    if what == "crash":
        raise RuntimeError(f"{name} crashed on purpose")
    if what == "die":
        os._exit(3)
    return StageResult(name, FAIL if what == "fail" else OK, f"{name} numbers")


STAGES = {name: partial(fake, name) for name in NAMES}
#: small limits: ``LOOPQ_FAKE_CAP`` seconds at most (default 5; twice that with --full), not started with less than
#: 0.5 s left
CAP = float(os.environ.get("LOOPQ_FAKE_CAP", "5"))
LIMITS = {name: Limits(CAP, 2 * CAP, 0.5) for name in NAMES}
