"""bench/async_ceiling.py: the loop's model runs on the orchestrator's own scheduling methods."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "bench-longtail.toml"


@pytest.fixture
def ceiling(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # as `python bench/async_ceiling.py` has it
    import async_ceiling

    return async_ceiling


def test_the_model_keeps_the_bound_and_a_looser_bound_waits_less(ceiling):
    run = lambda k, bound: ceiling.simulate(RECIPE, k, bound, 300, 2.45e-3, 5e-6, 0.1, 0.02)  # noqa: E731
    sync, strict, loose = run(0, None), run(2, None), run(2, 4)
    assert sync["lag_max"] == 0
    assert strict["lag_max"] == 2 and loose["lag_max"] <= 4
    assert sync["step_s"] > strict["step_s"] > loose["step_s"]
    # Waiting for a cohort's longest completion bounds the strict ratio below max_async + 1.
    assert sync["step_s"] / strict["step_s"] < 3
