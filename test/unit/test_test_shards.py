"""make test's node and serving tests run in two halves (conftest's ``--shard``): every selected file lands in
exactly one half, the halves' recorded times are near equal, and the record names files that exist."""
import json
import os

from conftest import DURATIONS, shards

HERE = os.path.dirname(DURATIONS)


def test_every_file_is_in_exactly_one_part_and_the_parts_are_balanced():
    times = {f"f{i}.py": float(t) for i, t in enumerate([40, 35, 30, 20, 12, 9, 5, 3, 2, 1])}
    files = sorted(times) + ["new_a.py", "new_b.py"]  # no recorded time: counted as the median (9 and 12: 12)
    for n in (1, 2, 3):
        parts = shards(files, times, n)
        assert sorted(f for p in parts for f in p) == sorted(files)
        loads = [sum(times.get(f, 12.0) for f in p) for p in parts]
        assert max(loads) - min(loads) <= 40.0  # greedy, longest first: within the longest file
    assert shards(files, times, 2) == shards(list(reversed(files)), times, 2)  # not the collection order


def test_the_recorded_times_name_existing_test_files():
    with open(DURATIONS, encoding="utf-8") as fh:
        times = json.load(fh)
    missing = [f for f in times if not os.path.isfile(os.path.join(HERE, f))]
    assert not missing, f"durations.json names files that are gone: {missing}"
    assert all(isinstance(t, (int, float)) and t > 0 for t in times.values())


def test_leave_out_deselects_the_files_refused_and_reports_them():
    from types import SimpleNamespace

    from conftest import leave_out
    reported = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: reported.extend(items)))
    items = [SimpleNamespace(nodeid=n) for n in ("a.py::x", "b.py::y", "a.py::z", "c.py::w")]
    leave_out(config, items, lambda f: f != "a.py")
    assert [i.nodeid for i in items] == ["b.py::y", "c.py::w"]
    assert [i.nodeid for i in reported] == ["a.py::x", "a.py::z"]
