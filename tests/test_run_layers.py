"""``make test``'s runner (tests/run_layers.py): every layer runs, and any one failing fails it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import run_layers

pytestmark = pytest.mark.integration  # it starts pytest processes

RUNNER = Path(__file__).resolve().parent / "run_layers.py"
INI = "[pytest]\nmarkers =\n    unit: u\n    integration: i\n    cluster: c\n    e2e: e\naddopts = --strict-markers\n"


def run(tmp_path: Path, *, unit_passes: bool, e2e_passes: bool, cluster_passes: bool = True) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_layers_here.py").write_text(
        "import pytest\n"
        f"@pytest.mark.unit\ndef test_fast():\n    assert {unit_passes}, 'the unit test failed'\n"
        f"@pytest.mark.cluster\ndef test_real():\n    assert {cluster_passes}, 'the cluster test failed'\n"
        f"@pytest.mark.e2e\ndef test_slow():\n    assert {e2e_passes}, 'the e2e test failed'\n")
    return subprocess.run([sys.executable, str(RUNNER), "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"),
                           "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_both_layers_pass_and_both_are_reported(tmp_path: Path) -> None:
    done = run(tmp_path, unit_passes=True, e2e_passes=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "===== unit and integration (run beside" in done.stdout
    assert "===== cluster (run beside" in done.stdout
    assert done.stdout.count("1 passed, 2 deselected") == 3
    assert "e2e exit 0" in done.stdout and "unit and integration exit 0" in done.stdout
    assert "cluster exit 0" in done.stdout


@pytest.mark.parametrize(("unit_passes", "e2e_passes", "cluster_passes"),
                         [(False, True, True), (True, False, True), (True, True, False)],
                         ids=["unit-fails", "e2e-fails", "cluster-fails"])
def test_a_failure_in_any_layer_fails_the_run_and_is_shown(tmp_path: Path, unit_passes: bool,
                                                           e2e_passes: bool, cluster_passes: bool) -> None:
    done = run(tmp_path, unit_passes=unit_passes, e2e_passes=e2e_passes, cluster_passes=cluster_passes)
    assert done.returncode == 1, done.stdout + done.stderr
    failed = "unit" if not unit_passes else "e2e" if not e2e_passes else "cluster"
    assert f"the {failed} test failed" in done.stdout


@pytest.mark.unit
def test_the_last_part_is_every_e2e_test_the_others_do_not_name() -> None:
    parts = run_layers.part_args([("a", ["tests/local"]), ("b", ["tests/trainer/test_elastic_ray.py"]), ("c", None)])
    root = run_layers.ROOT
    assert parts == [("a", [str(root / "tests/local")]), ("b", [str(root / "tests/trainer/test_elastic_ray.py")]),
                     ("c", [str(root / "tests"), f"--ignore={root / 'tests/local'}",
                            f"--ignore={root / 'tests/trainer/test_elastic_ray.py'}"])]


@pytest.mark.unit
def test_a_part_naming_a_path_that_is_gone_stops_the_run_naming_it() -> None:
    with pytest.raises(SystemExit, match=r"the e2e part 'a' names \['tests/nowhere'\]"):
        run_layers.part_args([("a", ["tests/nowhere"]), ("b", None)])


@pytest.mark.unit
def test_the_parts_of_make_test_name_paths_that_exist() -> None:
    assert [name for name, _ in run_layers.part_args(run_layers.E2E_PARTS)][-1] == "the rest"


@pytest.mark.unit
def test_make_test_leaves_the_long_stories_to_make_test_long_and_coverage_runs_both() -> None:
    default, long, every = run_layers.plan([]), run_layers.plan(["--long", "-x"]), run_layers.plan(["--all"])
    unit_and_integration = [(f"unit and integration ({name})", [*args, "-m", "unit or integration"])
                            for name, args in run_layers.part_args(run_layers.FAST_PARTS, collect_all=True)]
    assert len(unit_and_integration) == 2 and unit_and_integration[-1][1][0] == str(run_layers.ROOT / "tests")
    assert [args[-2:] for _, args in default.parts] == [["-m", "e2e and not long"]] * 3
    assert default.fast == unit_and_integration
    assert long.fast == [] and long.argv == ["-x"]
    assert [args[-2:] for _, args in long.parts] == [["-m", "e2e and long"]] * len(run_layers.LONG_PARTS)
    assert [args[-2:] for _, args in every.parts] == [["-m", "e2e"]] * 3 and every.fast == unit_and_integration
    fast = run_layers.plan(["--fast"])
    assert fast.parts == [] and fast.fast == unit_and_integration  # make test-fast
    # tests named: one e2e process on them, long stories included (only those with --long)
    assert run_layers.plan(["tests/trainer"]).parts == [("e2e", ["-m", "e2e"])]
    assert run_layers.plan(["--long", "tests/trainer"]).parts == [("e2e", ["-m", "e2e and long"])]
    # the cluster layer: one process of its own in make test and --all, none in --long and --fast
    assert default.cluster == every.cluster == [("cluster", [str(run_layers.ROOT / "tests"), "-m", "cluster"])]
    assert long.cluster == fast.cluster == []
    assert run_layers.plan(["tests/cluster"]).cluster == [("cluster", ["-m", "cluster"])]


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "named"), [([], False), (["-x", "-k", "drain"], False), (["tests/intake"], True),
                                              (["tests/ray/test_gcs.py::test_x"], True)])
def test_arguments_that_name_tests_run_the_e2e_layer_as_one_process(argv: list[str], named: bool) -> None:
    assert run_layers.names_tests(argv) is named


def collected(where: Path, *args: str) -> set[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-c", str(where / "pytest.ini"), "--rootdir", str(where), str(where), *args],
                          capture_output=True, text=True, timeout=300, cwd=where)
    assert done.returncode in (0, 5), done.stdout + done.stderr
    return {line.split("::")[1] for line in done.stdout.splitlines() if "::" in line}


def with_this_suites_layers(where: Path, *, long: bool = False) -> None:
    """A pytest.ini and a conftest that registers this suite's layer hook (tests/conftest.py)."""
    (where / "pytest.ini").write_text(INI.replace("    e2e: e\n", "    e2e: e\n    long: l\n") if long else INI)
    (where / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(run_layers.ROOT)!r})\n"
        "from tests.conftest import _ClosestLayer\n"
        "def pytest_configure(config):\n    config.pluginmanager.register(_ClosestLayer())\n")


def test_a_test_marked_apart_from_its_module_runs_in_its_own_layer_only(tmp_path: Path) -> None:
    """An e2e test in a unit module, with this suite's conftest hook: before the closest marker
    became the only one, `make test` ran such tests in both processes (19 of them)."""
    with_this_suites_layers(tmp_path)
    (tmp_path / "test_mixed.py").write_text(
        "import pytest\npytestmark = pytest.mark.unit\n"
        "def test_here():\n    pass\n"
        "@pytest.mark.e2e\ndef test_apart():\n    pass\n"
        "@pytest.mark.parametrize('x', [1, pytest.param(2, marks=pytest.mark.integration)])\n"
        "def test_some(x):\n    pass\n")
    assert collected(tmp_path, "-m", "e2e") == {"test_apart"}
    assert collected(tmp_path, "-m", "unit or integration") == {"test_here", "test_some[1]", "test_some[2]"}
    assert collected(tmp_path, "-m", "unit") == {"test_here", "test_some[1]"}


def test_a_long_story_whose_quick_form_is_gone_stops_the_collection_naming_it(tmp_path: Path) -> None:
    """The check runs in every session that collects the quick form's module: make test's fast
    layers collect them all, so a quick form renamed or deleted fails make test."""
    with_this_suites_layers(tmp_path, long=True)
    (tmp_path / "test_story.py").write_text(
        "import pytest\npytestmark = pytest.mark.e2e\n"
        "def test_quick():\n    pass\n"
        "@pytest.mark.long('test_story.py::test_quik')\ndef test_story():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path),
                           "-m", "unit or integration"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr  # pytest's usage error
    assert "test_story.py::test_story: its quick form test_story.py::test_quik is not a collected test" in done.stderr
    (tmp_path / "test_story.py").write_text((tmp_path / "test_story.py").read_text().replace("test_quik", "test_quick"))
    assert collected(tmp_path, "-m", "e2e and not long") == {"test_quick"}


@pytest.mark.unit
def test_the_last_fast_part_collects_the_whole_suite_and_deselects_what_the_others_run() -> None:
    """One session of every make test and make test-fast collects every module, so each long
    story's quick forms are checked against the whole suite (tests/conftest.py)."""
    parts = run_layers.part_args([("a", ["tests/local"]), ("b", ["tests/trainer/test_elastic_ray.py"]), ("c", None)],
                                 collect_all=True)
    assert parts[-1] == ("c", [str(run_layers.ROOT / "tests"), "--deselect=tests/local/",
                               "--deselect=tests/trainer/test_elastic_ray.py"])
    for plan in (run_layers.plan([]), run_layers.plan(["--fast"])):
        last = plan.fast[-1][1]
        assert last[0] == str(run_layers.ROOT / "tests") and not any(a.startswith("--ignore") for a in last)
        assert [a for a in last if a.startswith("--deselect")] == [f"--deselect={p}/" for p in run_layers.FAST_PARTS[0][1]]


@pytest.mark.unit
def test_the_drills_abrupt_story_is_left_to_make_test_long() -> None:
    """What the last fast part's collection checks is there: the drill's abrupt story is long."""
    from tests.local.drill import test_drill

    story = test_drill.test_an_abrupt_loss_resumes_from_the_last_periodic_checkpoint_and_says_what_it_cost
    assert "long" in [mark.name for mark in getattr(story, "pytestmark", [])]


def test_a_quick_form_in_a_deselected_module_is_still_checked(tmp_path: Path) -> None:
    """``--deselect`` leaves a module collected: a quick form renamed there stops the session
    that runs only the other modules."""
    with_this_suites_layers(tmp_path, long=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "test_quick.py").write_text("import pytest\npytestmark = pytest.mark.unit\n"
                                                      "def test_quik():\n    pass\n")
    (tmp_path / "test_story.py").write_text(
        "import pytest\npytestmark = pytest.mark.e2e\n"
        "@pytest.mark.long('other/test_quick.py::test_quick')\ndef test_story():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path),
                           "--deselect=other/", "-m", "unit or integration"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr  # pytest's usage error
    assert "its quick form other/test_quick.py::test_quick is not a collected test" in done.stderr
    quick = tmp_path / "other" / "test_quick.py"
    quick.write_text(quick.read_text().replace("test_quik", "test_quick"))
    assert collected(tmp_path, "--deselect=other/", "-m", "unit or integration") == set()
