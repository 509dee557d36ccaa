"""Evaluation: the lm-eval model ``"loopq"`` (:mod:`loopq.eval.lm`), the paper's benchmarks as offline lm-eval tasks
(:mod:`loopq.eval.tasks`) and PTQ-protocol perplexity (:mod:`loopq.eval.perplexity`). See ``README.md`` here.

Submodules are imported explicitly: :mod:`loopq.eval.perplexity` stays free of lm-eval for calibration-time use.
"""
