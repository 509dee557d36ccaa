"""python -m loopq.generate and loopq.models.generation: bad options are one line naming the flag, the CLI streams
the cached greedy continuation, sampling helpers, and lm-eval's generate_until on the cache."""

import hashlib
import shutil
import subprocess
import sys

import pytest
import torch
from lm_eval.api.instance import Instance

from loopq.artifacts import StudentFormatError, student_meta, write_student
from loopq.commands.generate import main
from loopq.errors import LoopQError, UsageError
from loopq.metrics.lm import LoopQLM
from loopq.models import load_looplm
from loopq.models.generation import generate, next_token, top_p_filter
from loopq.paths import REPO_ROOT
from tests.export.conftest import make_student
from tests.helpers import gpt2_tokenizer_copy

TEACHER = REPO_ROOT / "loopq/assets/tiny-ouro"
PROMPT = "The loop"


def tree_hash(root):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def teacher():
    return load_looplm(TEACHER).eval()


def test_cli_streams_the_cached_greedy_continuation(capsys, teacher):
    texts = main(["--model", str(TEACHER), "--prompt", PROMPT, "--max_new_tokens", "12"])
    streamed = capsys.readouterr().out
    assert streamed == PROMPT + texts[0] + "\n" and texts[0]
    assert main(["--model", str(TEACHER), "--prompt", PROMPT, "--max_new_tokens", "12", "--no_cache"]) == texts
    ids = torch.tensor([teacher_tokens(PROMPT)])
    rerun = generate(teacher, ids, max_new_tokens=12, use_cache=False)
    assert texts[0] == tokenizer().decode(rerun[0].tolist(), skip_special_tokens=False)


def test_cli_static_cache_and_graph_steps_continue_the_same_text(capsys):
    """``--static_cache`` and ``--cuda_graphs`` (eager on a CPU model) decode the growing cache's greedy text; a
    combination the fixed-shape step cannot serve is refused naming the flags."""
    args = ["--model", str(TEACHER), "--prompt", PROMPT, "--max_new_tokens", "12", "--device", "cpu"]
    want = main(args)
    assert main([*args, "--static_cache"]) == want and main([*args, "--cuda_graphs"]) == want
    with pytest.raises(UsageError, match=r"--cuda_graphs decodes every loop .*drop --no_cache, --exit_threshold"):
        main([*args, "--cuda_graphs", "--kv_bits", "8"])


def tokenizer():
    from loopq.data.tokenizer import load_tokenizer

    return load_tokenizer(TEACHER / "tokenizer.json")


def teacher_tokens(text):
    return tokenizer().encode(text, add_special_tokens=False).ids


def test_cli_prompts_file_and_sampling_are_seeded(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("First prompt\nSecond one\n")
    args = ["--model", str(TEACHER), "--prompts_file", str(prompts), "--max_new_tokens", "8", "--temperature", "0.9"]
    first = main([*args, "--top_p", "0.8", "--seed", "1"])
    assert len(first) == 2 and first == main([*args, "--top_p", "0.8", "--seed", "1"])
    assert capsys.readouterr().out.splitlines()[0].startswith("First prompt")


def test_cli_subprocess_one_line_error_exit_2():
    cmd = [sys.executable, "-m", "loopq.generate", "--model", str(TEACHER), "--prompt", "x", "--max_new_tokens", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == ["error: --max_new_tokens must be an integer >= 1, got 0"]


BAD = [
    (["--prompt", PROMPT, "--max_new_tokens", "0"], r"--max_new_tokens must be an integer >= 1"),
    (["--prompt", PROMPT, "--temperature", "-0.5"], r"--temperature must be >= 0"),
    (["--prompt", PROMPT, "--top_p", "0"], r"--top_p must be in \(0, 1\]"),
    (["--prompt", PROMPT, "--top_p", "1.5"], r"--top_p must be in \(0, 1\]"),
    (["--prompt", "  "], r"--prompt is empty"),
    (
        ["--prompt", PROMPT, "--max_new_tokens", "2048"],
        r"--prompt of \d+ tokens \+ --max_new_tokens 2048 exceeds .* 2048",
    ),
    (["--prompt", PROMPT, "--num_loops", "0"], r"--num_loops must be >= 1"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[b[1].split()[0] + str(i) for i, b in enumerate(BAD)])
def test_cli_bad_options_are_one_line_naming_the_flag(args, message):
    before = tree_hash(TEACHER)
    with pytest.raises(LoopQError, match=message) as err:
        main(["--model", str(TEACHER), *args])
    assert "\n" not in str(err.value) and tree_hash(TEACHER) == before


def test_cli_student_whose_teacher_moved_takes_its_teacher(tmp_path):
    """The student loader's error says to pass ``--teacher`` when the recorded teacher is gone, which
    loopq.generate did not take; now ``--student ... --teacher`` decodes as on the recorded teacher."""
    teacher = shutil.copytree(TEACHER, tmp_path / "teacher")
    student, promoted = make_student(load_looplm(teacher), a_bits=4)
    directory = tmp_path / "run" / "student"
    meta = student_meta(student, teacher, directory, [promoted], [1.0] * student.calibrated_loops, None)
    write_student(student, meta, directory)
    args = ["--student", str(directory), "--prompt", PROMPT, "--max_new_tokens", "6", "--device", "cpu"]
    want = main(args)
    moved = teacher.rename(tmp_path / "moved")
    with pytest.raises(StudentFormatError, match=r"pass the teacher directory \(--teacher\)$"):
        main(args)
    assert main([*args, "--teacher", str(moved)]) == want
    with pytest.raises(UsageError, match=r"^--teacher is the teacher directory of a --student; drop it"):
        main(["--model", str(moved), "--prompt", PROMPT, "--teacher", str(moved)])


def test_cli_reads_a_gpt2_tokenizer_directory(tmp_path):
    """loopq.generate looked only for tokenizer.json; a model with GPT-2's encoder.json + vocab.bpe (LoopFormer's
    format, which an export copies) was refused though the tokenizer loader reads it."""
    model = gpt2_tokenizer_copy(TEACHER, tmp_path / "gpt2")
    args = ["--prompt", PROMPT, "--max_new_tokens", "6", "--device", "cpu"]
    assert main(["--model", str(model), *args]) == main(["--model", str(TEACHER), *args])


def test_cli_prompts_file_with_an_empty_line_is_refused(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\n\nthree\n")
    before = prompts.read_bytes()
    with pytest.raises(LoopQError, match=r"--prompts_file .*prompts.txt: line 2 is empty"):
        main(["--model", str(TEACHER), "--prompts_file", str(prompts)])
    assert prompts.read_bytes() == before


def test_api_refuses_a_prompt_longer_than_the_context(teacher):
    ids = torch.zeros(1, teacher.max_positions, dtype=torch.long)
    with pytest.raises(LoopQError, match=r"--prompt of 2048 tokens \+ --max_new_tokens 1 exceeds"):
        generate(teacher, ids, max_new_tokens=1)
    with pytest.raises(LoopQError, match=r"--prompt is empty"):
        generate(teacher, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(LoopQError, match=r"--prompt is empty for a row"):
        generate(teacher, torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))


def test_top_p_keeps_the_smallest_nucleus_and_temperature_zero_is_argmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).log_softmax(-1)  # probs ~ 0.64, 0.24, 0.09, 0.03
    kept = torch.isfinite(top_p_filter(logits, 0.8))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.5)).tolist() == [[True, False, False, False]]
    assert int(next_token(logits)) == 0
    draws = {int(next_token(logits, 1.0, 0.8, torch.Generator().manual_seed(s))) for s in range(40)}
    assert draws == {0, 1}


def test_eos_stops_the_rows_that_produced_it(teacher):
    ids = torch.tensor([teacher_tokens(PROMPT)])
    first = int(generate(teacher, ids, max_new_tokens=1)[0, 0])
    out = generate(teacher, ids, max_new_tokens=8, eos_token_id=first)
    assert out.tolist() == [[first]]


def test_lm_eval_generate_until_uses_the_cache_and_stops_at_until(teacher):
    lm = LoopQLM.from_model(teacher, tokenizer(), max_length=64, max_gen_toks=10)
    ids = torch.tensor([teacher_tokens(PROMPT)])
    want = tokenizer().decode(generate(teacher, ids, max_new_tokens=10, use_cache=False)[0].tolist())
    req = Instance(request_type="generate_until", doc={}, arguments=(PROMPT, {"until": ["\u0000"]}), idx=0)
    assert lm.generate_until([req]) == [want]
    stop = want.strip().split()[1]
    req = Instance(request_type="generate_until", doc={}, arguments=(PROMPT, {"until": [stop]}), idx=0)
    assert lm.generate_until([req]) == [want.split(stop, 1)[0]]


def test_cli_prompts_file_too_long_line_is_refused_before_any_prompt_is_generated(tmp_path, capsys):
    """Line 2 was checked only after prompt 1 streamed, and the message said ``--prompt of N tokens``."""
    prompts = tmp_path / "prompts.txt"
    long = "word " * 1000
    prompts.write_text(f"First prompt\n{long}\n")
    tokens = len(teacher_tokens(long))
    assert tokens + 1100 > 2048 and len(teacher_tokens("First prompt")) + 1100 <= 2048
    with pytest.raises(LoopQError) as err:
        main(["--model", str(TEACHER), "--prompts_file", str(prompts), "--max_new_tokens", "1100"])
    assert str(err.value).startswith(
        f"--prompts_file {prompts} line 2 of {tokens} tokens + --max_new_tokens 1100 exceeds the model's context"
    )
    assert capsys.readouterr().out == ""


def test_cli_prompts_file_with_a_byte_order_mark_reads_the_text_after_it(tmp_path, capsys):
    """A UTF-8 BOM (Windows editors) stayed in the first prompt as U+FEFF, printed and tokenized with it."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"\xef\xbb\xbf" + PROMPT.encode() + b"\n")
    args = ["--max_new_tokens", "6", "--device", "cpu"]
    texts = main(["--model", str(TEACHER), "--prompts_file", str(prompts), *args])
    assert capsys.readouterr().out == PROMPT + texts[0] + "\n"
    assert texts == main(["--model", str(TEACHER), "--prompt", PROMPT, *args])


def test_cli_decode_memory_guard_sizes_the_cache_for_the_longest_prompt(tmp_path, monkeypatch):
    """The guard was given max_new_tokens + 1 tokens: the prompt's KV entries were left out of the cache size.
    tiny-ouro: 4 loops x 2 layers x tokens x 2 (K, V) x 128 hidden x 4 bytes = 8192 bytes per token; the longer
    line has 14 tokens, so with 8 new tokens the cache is 8192 x (14 + 8) = 180224 bytes (the old size: 8192 x 9)."""
    from loopq.errors import GuardError
    from loopq.planning import guards

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The loop\nThe loop runs over the same layers again and again\n")
    assert [len(teacher_tokens(line)) for line in prompts.read_text().splitlines()] == [3, 14]
    args = ["--model", str(TEACHER), "--prompts_file", str(prompts), "--max_new_tokens", "8", "--num_loops", "4"]
    monkeypatch.setattr(guards, "available_memory", lambda: 180224 - 1)
    with pytest.raises(GuardError, match=r"^--num_loops 4: .*a KV cache of up to"):
        main([*args, "--device", "cpu"])
    monkeypatch.setattr(guards, "available_memory", lambda: 180224)
    assert len(main([*args, "--device", "cpu"])) == 2
