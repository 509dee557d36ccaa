"""LoopQ's lm-evaluation-harness model: any :class:`~loopq.models.base.LoopLM`, scored the way lm-eval's ``HFLM`` does.

Registered as ``"loopq"``: ``simple_evaluate(model="loopq", model_args="pretrained=<dir>,num_loops=4")``, or wrap a
model that only exists in memory (a fake-quant student, an exported int model) with :meth:`LoopQLM.from_model`.

What is computed, for a context ``c`` and a continuation ``x`` tokenized as lm-eval's ``TemplateLM`` does it
(encode ``c`` and ``c + x``, split at ``len(enc(c))``, trailing spaces of ``c`` moved into ``x``):

    tokens = (enc(c) + enc(x))[-(L + 1):]          # keep the last L + 1 tokens (L = max_length)
    logp   = log_softmax(model(tokens[:-1]).logits)
    score  = sum_{i in x} logp[i - 1, tokens[i]]    greedy = all(argmax logp[i - 1] == tokens[i])

``loglikelihood_rolling`` splits a document into lm-eval's disjoint rolling windows (first window prefixed with the
EOS id, each later window conditions on the one token before it, every token predicted exactly once) and sums the
window scores. ``generate_until`` is greedy decoding with the looped KV cache
(:func:`loopq.models.generation.generate`): the context keeps its last ``min(max_length, max_positions) -
max_gen_toks`` tokens (at least one; lm-eval's ``HFLM`` keeps ``max_length - max_gen_toks``), so that generation
always has room, is run once, and every new token is one cached step; generation stops at the first ``until`` string,
after ``max_gen_toks`` tokens, or at the model's last position.

Batches are sorted by length (longest first) and right-padded with the EOS id. The models are causal, so tokens
after a sequence never change its logits (Parcae's seeded initial state depends only on seed and position).
``pretrained`` is any model directory :func:`loopq.artifacts.load_artifact` loads: a teacher (or hub id), a
student written by ``python -m loopq.fit`` (on its recorded teacher, whose tokenizer it uses) or an export written
by ``python -m loopq.export`` (packed W4A4/W4A8 model).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (indexes lm-eval's own models before "loopq" joins the registry)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tokenizers import Tokenizer
from torch import Tensor
from tqdm import tqdm

from loopq.artifacts import load_artifact, tokenizer_dir
from loopq.data.tokenizer import eos_id, load_tokenizer
from loopq.models.base import LoopLM, LoopLMError
from loopq.models.generation import generate
from loopq.quant.prepare import cast_student

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

#: a scoring request: (context tokens, continuation tokens)
TokenPair = tuple[list[int], list[int]]


def _positive_int(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or isinstance(value, bool):
        raise LoopLMError(f"model_args {name}={value!r}: expected an integer >= 1")
    return number


def _dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise LoopLMError(f"model_args dtype={value!r}: expected one of {sorted(DTYPES)} or auto")
    return DTYPES[value]


def model_arg_names() -> list[str]:
    """The ``model_args`` keys the ``loopq`` model takes: the parameters of :class:`LoopQLM`."""
    return [name for name in inspect.signature(LoopQLM.__init__).parameters if name != "self"]


def check_model_args(keys: Iterable[str]) -> None:
    """Refuse a ``model_args`` key that :class:`LoopQLM` does not take (a misspelling such as ``num_loop`` would
    otherwise end in a TypeError traceback), naming the accepted keys."""
    accepted = model_arg_names()
    unknown = [key for key in keys if key not in accepted]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], accepted, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise LoopLMError(
        f"--model_args: unknown key(s) {unknown} for the loopq model{hint}; it accepts {', '.join(accepted)}"
    )


def _available(device: str | torch.device) -> torch.device:
    """``device``, or CPU when it names CUDA on a machine without it (lm-eval's CLI defaults to ``cuda:0``)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        logger.warning("device %s requested but CUDA is not available; evaluating on cpu", device)
        return torch.device("cpu")
    return device


@register_model("loopq")
class LoopQLM(TemplateLM):
    """lm-eval ``LM`` over a looped LM; ``pretrained`` is a model directory or an in-memory :class:`LoopLM`.

    ``tokenizer`` defaults to the model directory's (``tokenizer.json`` or GPT-2 ``encoder.json`` + ``vocab.bpe``);
    ``num_loops`` defaults to the model's trained count; ``max_length`` is the scoring window L (contexts are cut from
    the left, rolling windows have L tokens).
    ``device``/``dtype`` move/cast the model (default: leave it where and as it is; directories load on CPU, fp32).
    """

    def __init__(
        self,
        pretrained: str | os.PathLike[str] | LoopLM,
        tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
        num_loops: int | str | None = None,
        batch_size: int | str = 8,
        max_length: int | str = 256,
        max_gen_toks: int | str = 256,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.model, tokenizer_home = self._resolve_model(pretrained, _dtype(dtype))
        self.tokenizer = self._resolve_tokenizer(tokenizer, tokenizer_home)
        if device is not None:
            self.model.to(_available(device))
        self.num_loops = None if num_loops in (None, "", "None") else _positive_int("num_loops", num_loops)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_length = _positive_int("max_length", max_length)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self._check_vocab()

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LoopQLM:
        """lm-eval's constructor from ``model_args`` (``pretrained=<dir>,num_loops=4``), keys checked first. A key
        given in ``model_args`` wins over lm-eval's own flag for it (``device=cpu`` there and ``--device``, which
        ``python -m loopq.eval`` always passes: lm-eval would pass both and fail with a TypeError)."""
        args = simple_parse_args_string(arg_string)
        check_model_args(args)
        extra = {k: v for k, v in (additional_config or {}).items() if k not in args}
        return super().create_from_arg_string(arg_string, extra)

    @classmethod
    def from_model(cls, model: LoopLM, tokenizer: str | os.PathLike[str] | Tokenizer, **kwargs: Any) -> LoopQLM:
        """Evaluate a model object as it is (fake-quant student, exported model) without saving it first."""
        return cls(pretrained=model, tokenizer=tokenizer, **kwargs)

    @staticmethod
    def _resolve_model(
        pretrained: str | os.PathLike[str] | LoopLM, dtype: torch.dtype | None
    ) -> tuple[LoopLM, Path | None]:
        """The model, and the directory its tokenizer is in (None for an in-memory model)."""
        if isinstance(pretrained, LoopLM):
            return (cast_student(pretrained, dtype).eval() if dtype is not None else pretrained.eval()), None
        artifact = load_artifact(pretrained, dtype=dtype)  # a teacher, a calibrated student or a packed export
        return artifact.model.eval(), tokenizer_dir(pretrained, artifact)

    @staticmethod
    def _resolve_tokenizer(tokenizer: str | os.PathLike[str] | Tokenizer | None, home: Path | None) -> Tokenizer:
        if isinstance(tokenizer, Tokenizer):
            return tokenizer
        if tokenizer is None:
            if home is None:
                raise LoopLMError("model_args tokenizer is required when evaluating an in-memory model")
            tokenizer = home  # its tokenizer.json, or GPT-2's encoder.json + vocab.bpe
        return load_tokenizer(tokenizer)

    def _check_vocab(self) -> None:
        vocab = getattr(self.model.config, "vocab_size", None)
        if vocab is not None and self.tokenizer.get_vocab_size() > vocab:
            raise LoopLMError(
                f"tokenizer has {self.tokenizer.get_vocab_size()} ids but the model's vocab_size is {vocab}; "
                "pass the tokenizer the model was trained with (model_args tokenizer=<path>)"
            )

    # ------------------------------------------------------------------ TemplateLM hooks
    @property
    def eot_token_id(self) -> int:
        return eos_id(self.tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Plain encoding, no BOS/EOS added (as HFLM does for causal models by default)."""
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    # ------------------------------------------------------------------ scoring
    @torch.inference_mode()
    def log_probs(self, batch: Tensor) -> Tensor:
        """``log_softmax`` of the model's logits for ``batch`` ``[B, S]``, in fp32."""
        logits = self.model(batch.to(self.device), num_loops=self.num_loops).logits
        return torch.log_softmax(logits.float(), dim=-1)

    def score_pairs(self, pairs: Sequence[TokenPair], progress: bool = False) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, greedy match) per (context, continuation) pair; see module docstring."""
        inputs = []
        for context, continuation in pairs:
            if not context or not continuation:
                raise ValueError("each request needs at least one context and one continuation token")
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"continuation of {len(continuation)} tokens exceeds max_length={self.max_length}; "
                    "raise model_args max_length"
                )
            inputs.append((context + continuation)[-(self.max_length + 1) :])
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        starts = range(0, len(order), self.batch_size)
        # disable=None: the bar is drawn on terminals only (in a log file it would be one line of \r updates)
        for start in tqdm(starts, desc="loopq scoring", unit="batch", disable=None if progress else True):
            batch = order[start : start + self.batch_size]
            logp = self.log_probs(self._pad([inputs[i][:-1] for i in batch]))
            for row, i in enumerate(batch):
                results[i] = _continuation_score(logp[row], inputs[i], len(pairs[i][1]))
        return results

    def _pad(self, rows: Sequence[Sequence[int]]) -> Tensor:
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long, device="cpu")
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long, device="cpu")
        return out

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        results = self.score_pairs([(ctx, cont) for _, ctx, cont in requests], progress=not disable_tqdm)
        for (key, _, _), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def rolling_windows(self, tokens: list[int]) -> list[TokenPair]:
        """lm-eval's disjoint rolling windows of ``max_length`` tokens (first one prefixed with the EOS id)."""
        windows = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1)
        return [make_disjoint_window(w) for w in windows]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        per_doc = [self.rolling_windows(self.tok_encode(req.args[0])) for req in requests]
        flat = [w for windows in per_doc for w in windows]
        scores = iter(score for score, _ in self.score_pairs(flat, progress=not disable_tqdm))
        totals = [sum(next(scores) for _ in windows) for windows in per_doc]
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding, one request at a time, stopped at the first ``until`` string or ``max_gen_toks``."""
        outputs = []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError("the loopq model only decodes greedily; set do_sample=False")
            until = handle_stop_sequences(kwargs.get("until"), eos=self.tok_decode([self.eot_token_id]))
            text = self.greedy(context, until, kwargs["max_gen_toks"])
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            outputs.append(text)
        return outputs

    def context_length(self, max_new_tokens: int) -> int:
        """How many of the context's last tokens :meth:`greedy` keeps: the window (``max_length``, at most the model's
        positions) less the tokens to generate, at least one."""
        return max(1, min(self.max_length, self.model.max_positions) - max_new_tokens)

    def greedy(self, context: str, until: Sequence[str], max_new_tokens: int) -> str:
        """Greedy continuation of the last :meth:`context_length` tokens of ``context``, cut before the first stop
        string."""
        tokens = (self.tok_encode(context) or [self.prefix_token_id])[-self.context_length(max_new_tokens) :]
        new: list[int] = []

        def stop(token: Tensor) -> bool:
            new.append(int(token[0]))
            return any(s in self.tok_decode(new) for s in until)

        room = self.model.max_positions - len(tokens)
        if room >= 1:
            ids = torch.tensor([tokens], device=self.device)
            generate(self.model, ids, max_new_tokens=min(max_new_tokens, room), num_loops=self.num_loops, on_token=stop)
        return _cut_at_stop(self.tok_decode(new), until)


def _continuation_score(logp: Tensor, tokens: list[int], n_cont: int) -> tuple[float, bool]:
    """Score the last ``n_cont`` of ``tokens`` from ``logp`` (row t predicts ``tokens[t + 1]``)."""
    n_in = len(tokens) - 1
    rows = logp[n_in - n_cont : n_in]
    target = torch.tensor(tokens[-n_cont:], dtype=torch.long, device=rows.device)
    picked = rows.gather(-1, target[:, None]).squeeze(-1)
    return float(picked.double().sum()), bool((rows.argmax(-1) == target).all())


def _cut_at_stop(text: str, until: Sequence[str]) -> str:
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text
