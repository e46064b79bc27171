"""The ``long`` marker's check (tests/support/layers.py): a story that ``make test`` leaves to
``make test-long`` is an e2e test and names quick forms that ``make test`` runs."""

from __future__ import annotations

import pytest

from tests.support.layers import long_problems

pytestmark = pytest.mark.unit

QUICK = "tests/a.py::test_quick"


def test_a_long_story_with_a_collected_quick_form_is_fine() -> None:
    assert long_problems([("tests/b.py::test_story", "e2e", (QUICK,)), (QUICK, "e2e", None)]) == []


def test_a_parametrized_quick_form_matches_its_parameter_sets_and_one_left_in_make_test_is_enough() -> None:
    items = [("tests/a.py::test_run[hf]", "e2e", None),
             ("tests/a.py::test_run[lightning]", "e2e", ("tests/a.py::test_run[hf]",)),
             ("tests/b.py::test_story", "e2e", ("tests/a.py::test_run",))]
    assert long_problems(items) == []


def test_a_long_test_that_is_not_e2e_is_refused() -> None:
    (problem,) = long_problems([("tests/b.py::test_story", "integration", (QUICK,)), (QUICK, "unit", None)])
    assert "tests/b.py::test_story: marked long but its layer is 'integration'" in problem


def test_a_long_test_without_a_quick_form_is_refused() -> None:
    (problem,) = long_problems([("tests/b.py::test_story", "e2e", ())])
    assert "marked long without a quick form" in problem


def test_a_quick_form_that_is_not_collected_is_refused_naming_it() -> None:
    (problem,) = long_problems([("tests/b.py::test_story", "e2e", ("tests/a.py::test_renamed",)),
                                (QUICK, "e2e", None)])
    assert problem == "tests/b.py::test_story: its quick form tests/a.py::test_renamed is not a collected test"


def test_a_quick_form_that_is_long_itself_is_refused() -> None:
    items = [("tests/b.py::test_story", "e2e", (QUICK,)), (QUICK, "e2e", ("tests/c.py::test_other",))]
    assert long_problems(items) == [f"tests/b.py::test_story: its quick form {QUICK} is long too: make test does not run it"]


def test_a_quick_form_in_a_module_this_session_did_not_collect_is_left_to_a_session_that_did() -> None:
    assert long_problems([("tests/b.py::test_story", "e2e", ("tests/elsewhere.py::test_x",))]) == []
