"""Generate text with a teacher, a calibrated student or an exported W4A4/W4A8 model, streaming tokens as they come:

    python -m loopq.generate --model loopq/assets/tiny-ouro --prompt "The loop" --max_new_tokens 24
    python -m loopq.generate --exported runs/tiny/exported --prompts_file prompts.txt --temperature 0.8 --top_p 0.9

The options, the looped KV cache (``--no_cache``: the full forward per token), early exit (``--exit_threshold``), the
quantized cache (``--kv_bits``) and why a quantized model's greedy tokens with and without the cache can differ (a
rounding tie of a 4-bit quantizer): docs/generation.md. The Python API is :func:`loopq.models.generation.generate`
(re-exported here); prompts of a ``--prompts_file`` (one per line) are generated one after the other so that each
streams.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer

from loopq.artifacts import load_artifact, tokenizer_dir
from loopq.commands.cli import Command
from loopq.data.tokenizer import eos_id, load_tokenizer
from loopq.devices import resolve_device
from loopq.errors import UsageError
from loopq.models import LoopLM
from loopq.models.early_exit import ExitStats, check_exit_model, check_exit_threshold
from loopq.models.generation import check_prompt, check_sampling, generate
from loopq.models.kv_quant import check_kv_bits
from loopq.planning.guards import check_decode_loops

__all__ = ["generate", "main"]


def artifact_choice(model: Path | None, student: Path | None, exported: Path | None) -> tuple[str, Path]:
    """The one artifact asked for: its kind (``teacher`` / ``student`` / ``export``) and path."""
    chosen = [(kind, path) for kind, path in (("teacher", model), ("student", student), ("export", exported)) if path]
    if len(chosen) != 1:
        raise UsageError("pass exactly one of --model (FP teacher), --student or --exported")
    return chosen[0]


def check_decoding(no_cache: bool, exit_threshold: float | None, kv_bits: int | None, fixed: str | None) -> None:
    """The decoding options agree; ``fixed``: ``--cuda_graphs`` or ``--static_cache`` when asked."""
    check_exit_threshold(exit_threshold)
    check_kv_bits(kv_bits)
    if no_cache and (exit_threshold is not None or kv_bits not in (None, 16)):
        raise UsageError("--exit_threshold and --kv_bits need the KV cache; drop --no_cache")
    if fixed and (no_cache or exit_threshold is not None or kv_bits not in (None, 16)):
        raise UsageError(
            f"{fixed} decodes every loop on a full-precision cache: drop --no_cache, --exit_threshold, --kv_bits"
        )


def read_prompts(prompt: str | None, prompts_file: Path | None) -> list[str]:
    """The prompts: ``--prompt``, or every line of ``--prompts_file``; an empty one is refused."""
    if (prompt is None) == (prompts_file is None):
        raise UsageError("pass exactly one of --prompt or --prompts_file")
    if prompt is not None:
        if not prompt.strip():
            raise UsageError("--prompt is empty; give some text to continue")
        return [prompt]
    lines = read_text(prompts_file, "--prompts_file").splitlines()
    empty = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if not lines or empty:
        where = f"line {empty[0]} is empty" if empty else "it has no lines"
        raise UsageError(f"--prompts_file {prompts_file}: {where}; write one non-empty prompt per line")
    return lines


def read_text(path: Path, key: str) -> str:
    """The UTF-8 text of the file an option names, without a leading byte-order mark (Windows editors write one; it
    was kept as U+FEFF in the first prompt); a missing, unreadable or non-UTF-8 file is one line naming both."""
    try:
        return path.read_text(encoding="utf-8").removeprefix("\ufeff")  # utf-8-sig, with the error offsets of the file
    except UnicodeDecodeError as err:
        raise UsageError(
            f"{key} {path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); save it as "
            "UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    except OSError as err:
        raise UsageError(f"{key} {path}: cannot be read ({err.strerror or err}); pass a text file") from None


def encode_prompts(
    net: LoopLM, tokenizer: Tokenizer, prompts: list[str], max_new_tokens: int, prompts_file: Path | None
) -> list[list[int]]:
    """Every prompt's token ids, each checked to fit the model's context with ``max_new_tokens`` - all before the
    first is generated, so a too-long line 2 no longer fails after prompt 1 streamed; the message names the file and
    line of a ``--prompts_file``."""
    encoded = []
    for line, text in enumerate(prompts, 1):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        what = "--prompt" if prompts_file is None else f"--prompts_file {prompts_file} line {line}"
        check_prompt(net, torch.tensor([ids], dtype=torch.long), None, max_new_tokens, what)
        encoded.append(ids)
    return encoded


def streamer(tokenizer: Tokenizer, out: Callable[[str], object]) -> Callable[[torch.Tensor], None]:
    """An ``on_token`` callback that writes the newly decoded text of row 0 (held back while it ends inside a
    multi-byte character)."""
    tokens: list[int] = []
    shown = 0

    def on_token(token: torch.Tensor) -> None:
        nonlocal shown
        tokens.append(int(token[0]))
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        if not text.endswith("\ufffd"):
            out(text[shown:])
            shown = len(text)

    return on_token


#: stream text to stdout as it comes
write = functools.partial(print, end="", flush=True)


def generate_text(
    model: Path | None = None,
    student: Path | None = None,
    exported: Path | None = None,
    prompt: str | None = None,
    prompts_file: Path | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    num_loops: int | None = None,
    seed: int = 0,
    no_cache: bool = False,
    device: str = "auto",
    exit_threshold: float | None = None,
    kv_bits: int | None = None,
    static_cache: bool = False,
    cuda_graphs: bool = False,
    teacher: Path | None = None,
) -> list[str]:
    """Generate from each prompt, streaming the text; returns the generated texts.

    Args:
        model: FP teacher directory (or hub id)
        student: calibrated student directory (python -m loopq.fit)
        exported: export directory (python -m loopq.export)
        prompt: the prompt text
        prompts_file: a text file with one prompt per line
        max_new_tokens: tokens to generate per prompt
        temperature: 0 = greedy (default); > 0 samples
        top_p: nucleus of the sampling distribution, in (0, 1]
        num_loops: loops per token (default: the trained count)
        seed: seed of the sampling draws
        no_cache: re-run the full forward per token (no KV cache)
        device: auto (cuda when available; default), cpu, cuda, cuda:N
        exit_threshold: Ouro early exit: stop looping a token at this threshold
        kv_bits: store the KV cache in 8 or 4 bits (16: as is)
        static_cache: decode on a preallocated KV cache with fixed-shape steps
        cuda_graphs: replay each decode step from one captured CUDA graph (implies --static_cache; eager on a CPU)
        teacher: with --student: its teacher directory when the recorded teacher path is gone (same content hash)
    """
    where = resolve_device(device)
    check_sampling(max_new_tokens, temperature, top_p)
    kind, path = artifact_choice(model, student, exported)
    if teacher is not None and kind != "student":
        raise UsageError("--teacher is the teacher directory of a --student; drop it with --model or --exported")
    fixed = "--cuda_graphs" if cuda_graphs else "--static_cache" if static_cache else None
    check_decoding(no_cache, exit_threshold, kv_bits, fixed)
    if num_loops is not None and num_loops < 1:
        raise UsageError(f"--num_loops must be >= 1, got {num_loops}")
    prompts = read_prompts(prompt, prompts_file)  # before the model loads: a bad file fails at once
    artifact = load_artifact(path, kind=kind, teacher=teacher, device=where)  # type: ignore[arg-type]
    net: LoopLM = artifact.model.eval()
    tokenizer = load_tokenizer(tokenizer_dir(path, artifact))  # tokenizer.json or GPT-2 encoder.json + vocab.bpe
    encoded = encode_prompts(net, tokenizer, prompts, max_new_tokens, prompts_file)  # before anything is printed
    # the KV cache holds the prompt and every new token: sized for the longest prompt, before any decoding
    check_decode_loops(net, num_loops, max(map(len, encoded)) + max_new_tokens)
    generator = torch.Generator(device=where).manual_seed(seed)
    if exit_threshold is not None:
        check_exit_model(net)
    stats = ExitStats()
    texts = []
    for text, prompt_ids in zip(prompts, encoded, strict=True):
        ids = torch.tensor([prompt_ids], device=where)
        write(text)
        new = generate(
            net,
            ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            num_loops=num_loops,
            generator=generator,
            eos_token_id=eos_id(tokenizer),
            use_cache=not no_cache,
            on_token=streamer(tokenizer, write),
            exit_threshold=exit_threshold,
            kv_bits=kv_bits,
            exit_stats=stats,
            static_cache=static_cache,
            cuda_graphs=cuda_graphs,
        )
        write("\n")
        texts.append(tokenizer.decode(new[0].tolist(), skip_special_tokens=False))
    if stats.exit_loops:
        loops = num_loops or net.resolve_num_loops(None)
        sys.stderr.write(
            f"early exit at threshold {exit_threshold}: {stats.mean_loops():.2f} of {loops} loops per decoded "
            f"token on average ({sum(x.numel() for x in stats.exit_loops)} tokens)\n"
        )
    return texts


COMMAND = Command(generate_text, "loopq.generate", __doc__)

build_parser, main = COMMAND.parser, COMMAND.run
