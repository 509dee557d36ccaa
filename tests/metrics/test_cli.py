"""How lm-eval finds the ``loopq`` model: ``python -m loopq.eval`` (which imports ``loopq.metrics.lm``) works offline on
the embedded teacher; lm-eval by itself does not know the name, because lm-eval 0.4.13 discovers no plugins."""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from loopq.paths import REPO_ROOT


def run(args, tmp_path):
    """A fresh interpreter with this checkout first on the path and every hub offline."""
    env = os.environ | {"PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_python_m_loopq_eval_scores_the_embedded_teacher_offline(tmp_path):
    teacher = REPO_ROOT / "loopq" / "assets" / "tiny-ouro"
    args = ["-m", "loopq.eval", "--model", "loopq", "--model_args", f"pretrained={teacher}"]
    args += ["--tasks", "loopq_lambada", "--limit", "2", "--output_path", str(tmp_path / "out")]
    done = run(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = (tmp_path / "out").rglob("results_*.json")
    scores = json.loads(result.read_text())["results"]["loopq_lambada"]
    assert 0 <= scores["acc,none"] <= 1 and scores["perplexity,none"] > 1


def test_lm_eval_reads_no_plugin_entry_points():
    """Why the README sends users to ``python -m loopq.eval``: the installed lm-eval never calls
    ``importlib.metadata.entry_points``, so no installed package can register a model with plain ``lm_eval``. If this
    fails, lm-eval has started discovering plugins: declare LoopQ's entry point in pyproject.toml and fix the README."""
    package = Path(importlib.util.find_spec("lm_eval").origin).parent
    callers = [p.relative_to(package) for p in package.rglob("*.py") if "entry_points(" in p.read_text("utf-8")]
    assert callers == []
    assert importlib.metadata.version("lm_eval") == "0.4.13"  # the version the README names
