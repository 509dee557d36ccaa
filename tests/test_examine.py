"""loopq.commands.examine: the transform spread and effective matrix by hand, knock-outs that do what they say and
leave the student alone, and the SLT history of a real (few-step) calibration agreeing with the student's own record."""

import copy
import json
from pathlib import Path

import pytest
import torch

import loopq.commands.examine as command
from loopq.artifacts.student import load_student
from loopq.commands.examine import (
    SEQ_LEN,
    effective_transform,
    inspect,
    knock_out_cta,
    knock_out_las,
    knock_out_slt,
    las_table,
    main,
    relative_spread,
    student_dir,
)
from loopq.data.tokenizer import load_tokenizer
from loopq.errors import UsageError
from loopq.metrics.perplexity import perplexity, wikitext2_stream
from loopq.quant.prepare import looped_quant_groups
from loopq.quant.transforms import KroneckerTransform


def test_relative_spread_by_hand():
    eye = torch.eye(3)
    assert relative_spread([eye, 3 * eye]) == pytest.approx(0.5)  # mean 2I: ||I - 2I|| / ||2I||
    assert relative_spread([eye, eye, eye]) == 0.0


def test_las_table_by_hand_with_a_shared_clip():
    """LAS off: most groups have one clip, promoted ones one per loop; the shared clip counts at every loop."""
    clips = {"l.0.mlp.down_proj": [0.9], "l.1.mlp.down_proj": [0.8, 1.0], "l.0.attn.o_proj": [0.5, 0.7]}
    table = las_table(clips)
    assert table[2] == "| down_proj | 0.850 / 0.950 | 0.000 | 0.200 |"  # rows [.9, .9], [.8, 1]; lower median
    assert table[3] == "| o_proj | 0.500 / 0.700 | 0.200 | 0.200 |"


def test_effective_transform_is_what_the_forward_applies():
    tr = KroneckerTransform(12)
    assert torch.allclose(effective_transform(tr), torch.eye(12))  # identity at init
    tr.randomize_(torch.Generator().manual_seed(0))
    x = torch.randn(5, 12)
    p1, p2, _, _ = tr.matrices()
    torch.testing.assert_close(x @ effective_transform(tr), tr.activation(x, p1, p2).detach(), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def run(tiny_calibration):
    """configs/tiny.yaml for 8 steps: LAS, CTA and two SLT rounds (steps 1 and 4), checkpoints every 3 steps (the
    suite's shared calibration, tests/conftest.py; read-only)."""
    return tiny_calibration


def test_slt_rounds_from_the_checkpoint_match_the_students_promotions(run):
    result = inspect(run, windows=2)
    meta = json.loads((run / "student" / "loopq_quant.json").read_text())
    rounds = result["slt"]["rounds"]
    assert [name for r in rounds for name in r["selected"]] == meta["promoted"] == result["slt"]["promoted"]
    assert [r["step"] for r in rounds] == [1, 4]
    for r in rounds:  # promoted = the round's argmax S
        assert r["largest_left"] is None or r["score"][0] >= r["largest_left"]
    assert result["mu"] == meta["mu"]
    assert len(result["cta"]["parameters"]) == len(result["cta"]["relative_change"]) == 3  # T - 1 transitions
    assert all(v > 0 for v in result["slt"]["transform_spread"].values())  # trained apart after promotion
    assert inspect(run / "student", windows=2)["slt"]["rounds"] == []  # a bare student has no history


def test_knock_outs_replace_by_the_loop_mean_and_leave_the_student_alone(run):
    student, _ = load_student(run / "student")
    before = copy.deepcopy(student.state_dict())
    las, slt, cta = copy.deepcopy(student), copy.deepcopy(student), copy.deepcopy(student)
    knock_out_las(las)
    for name, g in looped_quant_groups(las).items():
        original = looped_quant_groups(student)[name].act_clip
        assert torch.allclose(g.act_clip, original.mean().expand_as(original))
    knock_out_slt(slt)
    promoted = [g for g in looped_quant_groups(slt).values() if g.loop_transforms is not None]
    assert promoted
    for g in promoted:
        mats = [effective_transform(tr) for tr in g.loop_transforms]
        assert relative_spread(mats) < 1e-6  # every loop now has the same transform
    knock_out_cta(cta)
    ids = torch.randint(1, 200, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = cta(ids, return_trajectory=True)
        assert not out.transition_states
    assert all(torch.equal(v, student.state_dict()[k]) for k, v in before.items())


def test_knock_out_perplexities_are_fresh_measurements(run):
    result = inspect(run, windows=2)
    student, meta = load_student(run / "student")
    stream = torch.tensor(wikitext2_stream(load_tokenizer(meta["teacher"])))[: 2 * SEQ_LEN]
    as_trained = perplexity(student.eval(), stream, SEQ_LEN).ppl
    assert result["knock_outs"]["ppl"]["as trained"] == pytest.approx(as_trained, rel=1e-5)
    knock_out_cta(student)
    assert result["knock_outs"]["ppl"]["CTA -> identity"] == pytest.approx(perplexity(student, stream, SEQ_LEN).ppl)


def test_bad_paths_and_windows_fail_in_one_line(tmp_path):
    with pytest.raises(UsageError, match="neither a LoopQ student nor a run directory"):
        student_dir(tmp_path)
    with pytest.raises(UsageError, match="--windows 0"):
        main([str(tmp_path), "--windows", "0"])


def test_json_output_is_written_atomically(tmp_path, monkeypatch):
    """``--json`` was written with plain write_text: a write that fails half-way (disk full, a kill) destroyed the
    earlier file and left a torn one; now the earlier file stays as it was and no temporary file is left."""
    out = tmp_path / "numbers.json"
    earlier = '{"student": "earlier", "knock_outs": {}}\n'  # an earlier examine --json (the file it may replace)
    out.write_text(earlier)
    monkeypatch.setattr(command, "inspect", lambda path, windows, teacher=None: {"ppl": [1.0, 2.0, 3.0]})
    monkeypatch.setattr(command, "markdown", lambda result: "")
    real = Path.write_text

    def torn(self, data, *args, **kwargs):
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_text", torn)
        with pytest.raises(OSError, match="No space left"):
            command.examine(tmp_path / "run", json=out)
    assert out.read_text() == earlier and sorted(tmp_path.iterdir()) == [out]
    command.examine(tmp_path / "run", json=out)
    assert json.loads(out.read_text()) == {"ppl": [1.0, 2.0, 3.0]}


def test_a_student_whose_teacher_moved_is_examined_with_its_teacher(tmp_path):
    """As loopq.evaluate, export and generate: the loader's "pass the teacher directory (--teacher)" is an option."""
    import shutil

    from loopq.artifacts.student import StudentFormatError, student_meta, write_student
    from loopq.models import load_looplm
    from loopq.paths import ASSETS
    from tests.export.conftest import make_student

    teacher = shutil.copytree(ASSETS / "tiny-ouro", tmp_path / "teacher")
    student, promoted = make_student(load_looplm(teacher), a_bits=4)
    directory = tmp_path / "run" / "student"
    meta = student_meta(student, teacher, directory, [promoted], [1.0] * student.calibrated_loops, None)
    write_student(student, meta, directory)
    before = inspect(directory, 1)
    moved = teacher.rename(tmp_path / "moved")
    with pytest.raises(StudentFormatError, match=r"pass the teacher directory \(--teacher\)$"):
        main([str(directory), "--windows", "1"])
    after = main([str(directory), "--windows", "1", "--teacher", str(moved)])
    assert after["knock_outs"] == before["knock_outs"] and after["slt"] == before["slt"]
