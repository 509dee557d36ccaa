"""Several results of one Table-1 cell: loop-sweep rows never replace evaluated ones, and seeds are averaged -
whatever the order of the files (a reviewer found "later files win", with ``-s10`` sorting before ``-s2``)."""

from __future__ import annotations

from pathlib import Path

from loopq.commands.report.figures import series_points
from loopq.commands.report.inputs import load_result
from loopq.commands.report.write_report import main
from tests.test_report import metrics, result, table_lines, write


def report(tmp_path: Path, paths: list[Path], name: str = "report") -> str:
    return main(["--results", *map(str, paths), "--out", str(tmp_path / name)]).read_text()


def test_a_loop_sweep_row_never_replaces_the_evaluated_row_in_either_order(tmp_path):
    """``experiments loops`` writes ``fp-loops4.json`` (``per_loop_of``, no lm-eval) at the same T as ``fp.json``:
    given after it, it used to wipe the FP row's lm-eval columns."""
    d = tmp_path / "results"
    table = [
        write(d / "fp.json", result("FP", "fp", 4, 15.0, metrics(0.5, 0.6, 0.4, 0.3, 0.25, 20.0, 10.0))),
        write(d / "lq.json", result("LoopQ", "w4a4", 4, 18.0, metrics(0.4, 0.5, 0.3, 0.2, 0.2, 25.0, 12.0))),
        write(d / "quarot.json", result("QuaRot", "w4a4", 4, 40.0)),
        write(d / "rtn.json", result("RTN", "w4a4", 4, 60.0)),
    ]
    loops = [
        write(d / "loops" / "rtn-loops4.json", result("RTN", "w4a4", 4, 61.0, per_loop_of="rtn-loops8.json")),
        write(d / "loops" / "fp-loops4.json", result("FP", "fp", 4, 16.5, per_loop_of="fp-loops8.json")),
        write(d / "loops" / "lq-loops4.json", result("LoopQ", "w4a4", 4, 19.5, loop_sweep=8)),
        write(d / "loops" / "lq-loops8.json", result("LoopQ", "w4a4", 8, 22.0, loop_sweep=8)),
    ]
    first = table_lines(report(tmp_path, [*table, *loops], "a"), "Table 1")
    second = table_lines(report(tmp_path, [*loops, *table], "b"), "Table 1")
    fp = "*50.0* | *60.0* | *40.0* | *30.0* | *25.0* | *20.00* | *10.00* | *15.00*"
    assert first == second
    assert first[2] == f"| tiny-ouro (T=4) | *FP* | {fp} | {fp} |"
    # the baselines in order of appearance of their evaluated results, the sweep's RTN row replacing nothing
    assert [row.split(" | ")[1] for row in first[3:]] == ["QuaRot", "RTN", "LoopQ"]
    assert " | ".join(["–"] * 7) + " | 60.00 |" in first[4]
    assert first[5].startswith("|  | LoopQ | 40.0 | 50.0 | 30.0 | 20.0 | 20.0 | 25.00 | 12.00 | **18.00** |")


def test_a_sweep_row_alone_is_still_reported(tmp_path):
    only = write(tmp_path / "fp-loops4.json", result("FP", "fp", 4, 16.5, per_loop_of="fp-loops8.json"))
    assert "*16.50*" in table_lines(report(tmp_path, [only]), "Table 1")[2]


def seeded(tmp_path: Path, seed: int, ppl: float, hs: float, per_loop: list[float]) -> Path:
    data = result("LoopQ", "w4a4", 4, ppl, metrics(hs, None, None, None, None, None, None), per_loop=per_loop)
    return write(tmp_path / "results" / f"loopq-w4a4-s{seed}.json", {**data, "seed": seed})


def test_rows_that_differ_only_by_seed_are_averaged(tmp_path):
    """Seeds 0, 2, 10: ppl 20, 24, 28 -> mean 24, sample std sqrt((16 + 0 + 16) / 2) = 4; HS 40, 50, 60 % -> 50.0 ±
    10.0; per loop t=1 30, 34, 38 -> 34.00 ± 4.00, t=2 20, 24 (seed 10 has one loop) -> 22.00 ± 2.83."""
    paths = [
        seeded(tmp_path, 0, 20.0, 0.40, [30.0, 20.0]),
        seeded(tmp_path, 2, 24.0, 0.50, [34.0, 24.0]),
        seeded(tmp_path, 10, 28.0, 0.60, [38.0]),
        write(tmp_path / "results" / "rtn.json", result("RTN", "w4a4", 4, 60.0, {"HS": 0.3})),
    ]
    md = report(tmp_path, sorted(paths))  # lexicographic: -s0, -s10, -s2
    reverse = report(tmp_path, paths[::-1], "reversed")
    for heading in ("Table 1", "WikiText-2 perplexity per loop"):
        assert table_lines(md, heading) == table_lines(reverse, heading)
    rows = table_lines(md, "Table 1")
    rest = " | ".join(["–"] * 8)
    assert rows[2] == "| tiny-ouro (T=4) | RTN | 30.0 | – | – | – | – | – | – | 60.00 | " + rest + " |"
    loopq = "**50.0 ± 10.0 (n=3)** | – | – | – | – | – | – | **24.00 ± 4.00 (n=3)**"
    assert rows[3] == f"|  | LoopQ | {loopq} | {rest} |"
    per_loop = table_lines(md, "WikiText-2 perplexity per loop")
    assert per_loop[2] == "| tiny-ouro | LoopQ | w4a4 | 34.00 ± 4.00 (n=3) | 22.00 ± 2.83 (n=2) |"
    assert "tiny-ouro: LoopQ w4a4 at T=4 is the mean over seeds 0, 2, 10" in md


def test_a_single_seed_row_looks_as_before(tmp_path):
    md = report(tmp_path, [seeded(tmp_path, 3, 20.0, 0.40, [30.0, 20.0])])
    assert table_lines(md, "Table 1")[2].startswith("| tiny-ouro (T=4) | LoopQ | 40.0 | – |")
    assert table_lines(md, "Table 1")[2].endswith("| 20.00 | – | – | – | – | – | – | – | – |")
    assert "mean over seeds" not in md


def test_figure_points_average_over_seeds(tmp_path):
    """Fig. 5: T=2 at seeds 0 and 1 (30 and 34) -> 32; T=4 at seeds 0 and 1 (20 and 24) -> 22; a re-evaluation of
    seed 0 at T=4 (26) replaces the earlier file of that seed -> (26 + 24) / 2 = 25."""
    found = []
    for seed, t, ppl in ((0, 2, 30.0), (1, 2, 34.0), (0, 4, 20.0), (1, 4, 24.0)):
        data = {**result("LoopQ", "w4a4", t, ppl), "seed": seed}
        found.append(load_result(write(tmp_path / f"s{seed}-T{t}.json", data)))
    key = ("tiny-ouro", "LoopQ", "w4a4", None)
    assert series_points(found, lambda r: r.num_loops) == {key: [(2, 32.0), (4, 22.0)]}
    again = load_result(write(tmp_path / "again.json", {**result("LoopQ", "w4a4", 4, 26.0), "seed": 0}))
    assert series_points([*found, again], lambda r: r.num_loops) == {key: [(2, 32.0), (4, 25.0)]}
