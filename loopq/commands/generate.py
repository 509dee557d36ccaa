"""Generate text with a teacher, a calibrated student or an exported W4A4/W4A8 model, streaming tokens as they come:

    python -m loopq.generate --model loopq/assets/tiny-ouro --prompt "The loop" --max_new_tokens 24
    python -m loopq.generate --exported runs/tiny/exported --prompts_file prompts.txt --temperature 0.8 --top_p 0.9

``--exit_threshold X`` (Ouro) stops looping each decoded token at its threshold exit and reports the average loops per
token at the end; ``--kv_bits 8|4`` stores the cache quantized (:mod:`loopq.models.kv_quant`).
Greedy by default; ``--temperature`` > 0 samples (``--top_p`` keeps the nucleus, ``--seed`` fixes the draws).
Decoding uses the looped KV cache (:mod:`loopq.models.kv_cache`: one K/V entry per (loop, layer)); ``--no_cache``
re-runs the full looped forward for every token, for comparison - both give the same greedy tokens. The Python API
is :func:`loopq.models.generation.generate` (re-exported here); prompts of a ``--prompts_file`` (one per line) are
generated one after the other so that each streams.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer

from loopq.artifacts import load_artifact, tokenizer_dir
from loopq.data.tokenizer import eos_id, load_tokenizer
from loopq.devices import resolve_device
from loopq.errors import OneLineParser, UsageError, run_cli
from loopq.models import LoopLM
from loopq.models.early_exit import ExitStats, check_exit_model, check_exit_threshold
from loopq.models.generation import check_prompt, check_sampling, generate
from loopq.models.kv_quant import check_kv_bits
from loopq.planning.guards import check_decode_loops

__all__ = ["generate", "main"]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, str, Path]:
    """The options, the artifact kind (``teacher`` / ``student`` / ``export``) and its path."""
    parser = OneLineParser(prog="python -m loopq.generate", description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", type=Path, help="FP teacher directory (or hub id)")
    model.add_argument("--student", type=Path, help="calibrated student directory (python -m loopq.fit)")
    model.add_argument("--exported", type=Path, help="export directory (python -m loopq.export)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompts_file", type=Path, help="a text file with one prompt per line")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus of the sampling distribution, in (0, 1]")
    parser.add_argument("--num_loops", type=int, default=None, help="loops per token (default: the trained count)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling draws")
    parser.add_argument("--no_cache", action="store_true", help="re-run the full forward per token (no KV cache)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available; default), cpu, cuda, cuda:N")
    parser.add_argument(
        "--exit_threshold", type=float, default=None, help="Ouro early exit: stop looping a token at this threshold"
    )
    parser.add_argument("--kv_bits", type=int, default=None, help="store the KV cache in 8 or 4 bits (16: as is)")
    parser.add_argument(
        "--static_cache", action="store_true", help="decode on a preallocated KV cache with fixed-shape steps"
    )
    parser.add_argument(
        "--cuda_graphs",
        action="store_true",
        help="replay each decode step from one captured CUDA graph (implies --static_cache; eager on a CPU)",
    )
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    check_sampling(args.max_new_tokens, args.temperature, args.top_p)
    check_exit_threshold(args.exit_threshold)
    check_kv_bits(args.kv_bits)
    if args.no_cache and (args.exit_threshold is not None or args.kv_bits not in (None, 16)):
        raise UsageError("--exit_threshold and --kv_bits need the KV cache; drop --no_cache")
    fixed = "--cuda_graphs" if args.cuda_graphs else "--static_cache" if args.static_cache else None
    if fixed and (args.no_cache or args.exit_threshold is not None or args.kv_bits not in (None, 16)):
        raise UsageError(
            f"{fixed} decodes every loop on a full-precision cache: drop --no_cache, --exit_threshold, --kv_bits"
        )
    if args.num_loops is not None and args.num_loops < 1:
        raise UsageError(f"--num_loops must be >= 1, got {args.num_loops}")
    kind, path = next((k, p) for k in ("model", "student", "exported") if (p := getattr(args, k)) is not None)
    return args, {"model": "teacher", "student": "student", "exported": "export"}[kind], path


def read_prompts(prompt: str | None, prompts_file: Path | None) -> list[str]:
    """The prompts: ``--prompt``, or every line of ``--prompts_file``; an empty one is refused."""
    if prompt is not None:
        if not prompt.strip():
            raise UsageError("--prompt is empty; give some text to continue")
        return [prompt]
    assert prompts_file is not None
    lines = read_text(prompts_file, "--prompts_file").splitlines()
    empty = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if not lines or empty:
        where = f"line {empty[0]} is empty" if empty else "it has no lines"
        raise UsageError(f"--prompts_file {prompts_file}: {where}; write one non-empty prompt per line")
    return lines


def read_text(path: Path, key: str) -> str:
    """The UTF-8 text of the file an option names; a missing, unreadable or non-UTF-8 file is one line naming both."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(
            f"{key} {path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); save it as "
            "UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    except OSError as err:
        raise UsageError(f"{key} {path}: cannot be read ({err.strerror or err}); pass a text file") from None


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


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> list[str]:
    args, kind, path = parse_args(argv)
    prompts = read_prompts(args.prompt, args.prompts_file)  # before the model loads: a bad file fails at once
    artifact = load_artifact(path, kind=kind, device=args.device)  # type: ignore[arg-type]
    model: LoopLM = artifact.model.eval()
    check_decode_loops(model, args.num_loops, args.max_new_tokens + 1)  # before any prompt is encoded or decoded
    tokenizer = load_tokenizer(tokenizer_dir(path, artifact) / "tokenizer.json")
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    if args.exit_threshold is not None:
        check_exit_model(model)
    stats = ExitStats()
    texts = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids], device=args.device)

        check_prompt(model, ids, None, args.max_new_tokens)  # before anything is printed
        write(prompt)
        new = generate(
            model,
            ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            num_loops=args.num_loops,
            generator=generator,
            eos_token_id=eos_id(tokenizer),
            use_cache=not args.no_cache,
            on_token=streamer(tokenizer, write),
            exit_threshold=args.exit_threshold,
            kv_bits=args.kv_bits,
            exit_stats=stats,
            static_cache=args.static_cache,
            cuda_graphs=args.cuda_graphs,
        )
        write("\n")
        texts.append(tokenizer.decode(new[0].tolist(), skip_special_tokens=False))
    if stats.exit_loops:
        loops = args.num_loops or model.resolve_num_loops(None)
        sys.stderr.write(
            f"early exit at threshold {args.exit_threshold}: {stats.mean_loops():.2f} of {loops} loops per decoded "
            f"token on average ({sum(x.numel() for x in stats.exit_loops)} tokens)\n"
        )
    return texts


if __name__ == "__main__":
    run_cli(main)
