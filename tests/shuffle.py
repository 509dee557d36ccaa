"""Shuffled test order, seed-controlled: a test that passes only after another one ran (a file it left, a global it
set) fails in some order, and the seed printed in the header reproduces that order. A pytest plugin, loaded by
``tests/conftest.py``.

``--shuffle-seed N`` orders the tests by seed ``N``; without it a seed is drawn and printed
(``test order: shuffled, --shuffle-seed 1234``); ``--shuffle-seed none`` keeps the collected order. Under
``pytest-xdist`` the controller draws the seed and hands it to every worker (the workers must collect the same
order).

What is shuffled: the order of the test files, of the classes in a file, and of the tests in a class. Tests that
share a parametrized module- or class-scoped fixture value stay together (shuffled among themselves), so an
expensive fixture is still built once per value.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence

import pytest

OPTION = "--shuffle-seed"
WORKER_KEY = "loopq_shuffle_seed"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        default=None,
        help="order the tests by this seed (an integer); 'none': the collected order; default: a random seed, printed",
    )


def parse_seed(text: str | None) -> int | None:
    """``--shuffle-seed``'s value: an int, None for 'none' / 'off', a fresh random seed when not given."""
    if text is None:
        return random.SystemRandom().randrange(10**6)
    if text.lower() in ("none", "off", "no"):
        return None
    try:
        return int(text)
    except ValueError:
        raise pytest.UsageError(
            f"{OPTION} {text}: not an integer; pass a seed, or 'none' for the collected order"
        ) from None


SEED_KEY = pytest.StashKey[int | None]()


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and WORKER_KEY in workerinput:
        config.stash[SEED_KEY] = workerinput[WORKER_KEY]
    else:
        config.stash[SEED_KEY] = parse_seed(config.getoption(OPTION))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist (controller): every worker orders by the controller's seed."""
    node.workerinput[WORKER_KEY] = node.config.stash[SEED_KEY]


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.stash.get(SEED_KEY, None)
    if seed is None:
        return f"test order: as collected ({OPTION} none)"
    return f"test order: shuffled, {OPTION} {seed} (pass it to rerun this order)"


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The seed again at the end (``-q`` hides the header), where a failing run's reader looks."""
    terminalreporter.write_line(pytest_report_header(config))


def high_scope_params(item: pytest.Item) -> Hashable:
    """The values of the item's parametrized fixtures of a scope above the function: items that share them share
    one fixture instance."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return ()
    scopes = getattr(callspec, "_arg2scope", {})
    return tuple(
        sorted(
            (name, index)
            for name, index in callspec.indices.items()
            if getattr(scopes.get(name), "value", "function") != "function"
        )
    )


def grouped(items: Sequence[pytest.Item], key: Callable[[pytest.Item], Hashable]) -> list[list[pytest.Item]]:
    """``items`` in groups of equal ``key``, groups in order of first appearance, items in their order."""
    groups: dict[Hashable, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


def shuffled(items: Sequence[pytest.Item], seed: int) -> list[pytest.Item]:
    """Files, then classes in a file, then blocks of shared high-scope fixture values, then tests: each level
    shuffled by one ``random.Random(seed)``; a pure function of the collected order and the seed."""
    rng = random.Random(seed)
    order: list[pytest.Item] = []
    files = grouped(items, lambda item: str(item.path))
    rng.shuffle(files)
    for in_file in files:
        classes = grouped(in_file, lambda item: getattr(getattr(item, "cls", None), "__qualname__", None))
        rng.shuffle(classes)
        for in_class in classes:
            blocks = grouped(in_class, high_scope_params)
            rng.shuffle(blocks)
            for block in blocks:
                rng.shuffle(block)
                order.extend(block)
    return order


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """After pytest's own reordering (which groups tests by shared fixture values)."""
    seed = config.stash.get(SEED_KEY, None)
    if seed is not None:
        items[:] = shuffled(items, seed)
