"""Evaluation: the lm-eval model ``"loopq"`` (:mod:`loopq.metrics.lm`), the paper's benchmarks as offline lm-eval tasks
(:mod:`loopq.metrics.tasks`) and PTQ-protocol perplexity (:mod:`loopq.metrics.perplexity`). See ``README.md`` here.

Submodules are imported explicitly: :mod:`loopq.metrics.perplexity` stays free of lm-eval for calibration-time use.
"""
