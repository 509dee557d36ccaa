"""The offline task suite: every task parses, loads the real local files and scores a few documents end to end."""

import math

import pytest
from lm_eval import simple_evaluate

from loopq.metrics.lm import LoopQLM
from loopq.metrics.tasks import PAPER_GROUP, PAPER_METRICS, TASKS_DIR, paper_metrics, task_manager
from loopq.metrics.tasks.utils import (
    capitalize_ctx_b,
    load_arc_challenge,
    load_hellaswag,
    load_lambada,
    load_winogrande,
    split_wikitext_articles,
)

LEAVES = ["loopq_hellaswag", "loopq_winogrande", "loopq_lambada", "loopq_arc_challenge", "loopq_wikitext"]


@pytest.fixture(scope="module")
def manager():
    return task_manager()


@pytest.fixture(scope="module")
def lm(ouro_dir):
    # the char-level test tokenizer makes long continuations (a HellaSwag ending is up to ~80 tokens)
    return LoopQLM(pretrained=str(ouro_dir), max_length=128, batch_size=16)


def test_paper_group_resolves_to_the_six_tasks_and_seven_metrics(manager, data):
    loaded = manager.load([PAPER_GROUP])
    subjects = {p.name.removesuffix("_test.csv") for p in (data / "mmlu" / "test").glob("*.csv")}
    assert len(subjects) == 57
    assert set(loaded["tasks"]) == set(LEAVES) | {f"loopq_mmlu_{s}" for s in subjects}
    assert loaded["group_map"][PAPER_GROUP] == [*LEAVES[:4], "loopq_mmlu", LEAVES[4]]
    assert len(PAPER_METRICS) == 7
    assert {task for task, _ in PAPER_METRICS.values()} <= set(loaded["tasks"]) | set(loaded["groups"])


def test_every_yaml_is_indexed(manager):
    names = {p.stem for p in TASKS_DIR.rglob("*.yaml") if not p.stem.startswith("_")}
    assert names <= set(manager.all_tasks)
    assert {"loopq_paper", "loopq_mmlu", "loopq_mmlu_stem"} <= set(manager.all_groups)


@pytest.mark.parametrize(
    ("task", "limit", "metrics"),
    [
        ("loopq_hellaswag", 3, {"acc": (0, 1), "acc_norm": (0, 1)}),
        ("loopq_winogrande", 3, {"acc": (0, 1)}),
        ("loopq_lambada", 3, {"acc": (0, 1), "perplexity": (1, math.inf)}),
        ("loopq_arc_challenge", 3, {"acc": (0, 1), "acc_norm": (0, 1)}),
        ("loopq_mmlu", 3, {"acc": (0, 1)}),  # 3 questions from each of the 57 subjects
        ("loopq_wikitext", 3, {"word_perplexity": (1, math.inf), "byte_perplexity": (1, 256), "bits_per_byte": (0, 8)}),
    ],
)
def test_task_scores_real_documents(lm, manager, task, limit, metrics):
    out = simple_evaluate(
        model=lm, tasks=[task], limit=limit, task_manager=manager, bootstrap_iters=0, log_samples=False
    )
    result = out["results"][task]
    for metric, (low, high) in metrics.items():
        assert low <= result[f"{metric},none"] <= high, (metric, result)
    for column, (name, metric) in PAPER_METRICS.items():
        if name == task:
            assert paper_metrics(out["results"])[column] == result[f"{metric},none"]


def test_loaders_read_the_full_releases():
    assert len(load_hellaswag()["validation"]) == 10042
    assert len(load_winogrande()["validation"]) == 1267
    assert len(load_lambada()["test"]) == 5153
    arc = load_arc_challenge()
    assert (len(arc["test"]), len(arc["validation"])) == (1172, 299)


def test_hellaswag_matches_the_stock_preprocessing():
    first = load_hellaswag()["validation"][0]
    assert first["query"] == "Roof shingle removal: A man is sitting on a roof. He"  # stock: ctx_b.capitalize()
    assert first["gold"] == 3 and len(first["choices"]) == 4
    assert capitalize_ctx_b("Bowling: A man bowls. the Man") == "Bowling: A man bowls. The man"
    assert capitalize_ctx_b("How to cook. Boil the water.") == "How to cook. Boil the water."  # WikiHow: no ctx_b


def test_arc_digit_answer_keys_resolve(manager):
    task = manager.load(["loopq_arc_challenge"])["tasks"]["loopq_arc_challenge"]
    digit = next(doc for doc in task.test_docs() if doc["answerKey"].isdigit())
    gold = digit["choices"]["label"].index(digit["answerKey"])
    assert task.doc_to_target(digit) == gold
    assert task.doc_to_choice(digit)[gold] == digit["choices"]["text"][gold]


def test_wikitext_articles_follow_document_level_split(data):
    raw = (data / "wikitext2" / "wiki.test.raw").read_text(encoding="utf-8")
    articles = split_wikitext_articles(raw)
    assert len(articles) == 62
    assert articles[0].startswith(" = Robert Boulter = \n")
    assert all(a.lstrip().startswith("= ") and not a.lstrip().startswith("= =") for a in articles)
