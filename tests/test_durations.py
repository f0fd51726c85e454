"""tests/durations.py: a JUnit report's times, per file and per test, written out by hand; and the order in which
xdist hands the files out (tests/conftest.py)."""

from __future__ import annotations

from tests.durations import read_cases, tables

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_dag" name="test_walk" time="30.0"/>
<testcase classname="tests.test_cost" name="test_a[1]" time="1.5"><skipped message="no"/></testcase>
<testcase classname="tests.test_cost" name="test_b" time="8.5"><failure message="x"/></testcase>
<testcase classname="tests.test_cost.TestGroup" name="test_c" time="0.0"/>
</testsuite></testsuites>
"""


def test_the_tables_sum_each_file_and_list_the_slowest_tests_first(tmp_path):
    path = tmp_path / "report.xml"
    path.write_text(REPORT)
    cases = read_cases([path])
    assert cases == [("tests/test_dag.py", "test_walk", 30.0, "passed"), ("tests/test_cost.py", "test_a[1]", 1.5,
                     "skipped"), ("tests/test_cost.py", "test_b", 8.5, "failure"),
                     ("tests/test_cost.py", "TestGroup::test_c", 0.0, "passed")]
    text = tables(cases, top=2)
    assert text.startswith("4 tests, 40 s in all; the Ray files (one worker, in turn) 30 s.")
    assert "| `tests/test_dag.py` | 1 | 30.0 | 75.0% | yes |\n| `tests/test_cost.py` | 3 | 10.0 | 25.0% |  |" in text
    assert text.endswith("| `tests/test_dag.py::test_walk` | 30.0 | passed |\n| `tests/test_cost.py::test_b` | 8.5 | "
                         "failure |")


def test_a_report_of_no_time_gives_no_shares_rather_than_a_division_by_zero():
    assert "| `tests/test_cost.py` | 1 | 0.0 | - |  |" in tables([("tests/test_cost.py", "test_a", 0.0, "passed")], 5)


def test_the_ray_files_unit_is_handed_out_first():
    """xdist hands units out with popitem(last=False): the Ray files' unit comes first wherever it sits in the queue,
    then the others in their order; a unit put back (a crashed worker's) is first again."""
    from tests.conftest import RayFirst

    queue = RayFirst()
    queue.update({"tests/test_a.py": {"a": False}, "tests/test_b.py": {"b": False}, "ray": {"r": False}})
    assert [queue.popitem(last=False)[0] for _ in range(2)] == ["ray", "tests/test_a.py"]
    queue.update({"ray": {"r": False}})
    assert queue.popitem(last=False) == ("ray", {"r": False})
    assert queue.popitem() == ("tests/test_b.py", {"b": False}) and not queue
    queue.update({"tests/test_c.py": {"c": False}})
    assert queue.popitem(last=False)[0] == "tests/test_c.py"  # no Ray unit: the queue's own order
