"""Shared pytest setup and fixtures: tests import the installed package (see the Makefile's `test` target).

Markers (the Makefile selects by them): ``simulator`` (a vendor NPU simulator: QNN's, RKNN's) and ``reference``
(compared with a reference implementation: transformers, LeRobot in .venv-pi0ref) run in ``make
test-reference``, the others in ``make test``; ``serve`` (a local Ray) with the node tests; ``gpu`` (needs a
CUDA device; skipped elsewhere with the reason).

The fixtures that start nodes use the DDS domain ``ROS_DOMAIN_ID`` when the environment sets it (``colcon
test`` runs the tests through ament_cmake_ros's isolation runner, which sets a free one), else a domain picked
for this test session.

``--shard K/N`` runs the K-th of N parts of the selected test files, parted by their recorded times
(``durations.json``), so that `make test` runs the node and serving tests in two processes that end together;
``--record-durations`` writes the times of the files a run ran into that record (``make test
PYTEST_ARGS=--record-durations`` after adding or changing a slow test file); ``--quick S`` leaves out the files
recorded at over S seconds (`make check`: the unit tests in under 2 minutes; `make test` runs them all).
"""
import json
import os
import shutil
import tempfile
import uuid

import pytest
import yaml


def pytest_configure(config):
    config.addinivalue_line("markers", "simulator: runs a vendor NPU simulator (QNN HTP, RKNN); in make "
                                       "test-reference")
    config.addinivalue_line("markers", "reference: compared with a reference implementation (transformers, "
                                       "LeRobot); in make test-reference")
    config.addinivalue_line("markers", "serve: starts synflux-serve (a local Ray); make test runs these with the "
                                       "node tests")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (and, for engines, TensorRT); skipped elsewhere "
                                       "with the reason")


def pytest_addoption(parser):
    parser.addoption("--shard", default="", metavar="K/N",
                     help="run the K-th of N parts of the selected test files, parted by durations.json")
    parser.addoption("--quick", type=float, default=0.0, metavar="SECONDS",
                     help="leave out the test files whose recorded time (durations.json) is over SECONDS")
    parser.addoption("--record-durations", action="store_true",
                     help="write each file's time in this run (setup, call and teardown) into durations.json")


DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")


def shards(files: list[str], times: dict[str, float], n: int) -> list[list[str]]:
    """Files parted into ``n`` lists of near-equal total time: the longest first, each to the least loaded
    list (a file without a recorded time counts as the median of those with one)."""
    known = sorted(times[f] for f in files if f in times) or [1.0]
    default = known[len(known) // 2]
    parts, loads = [[] for _ in range(n)], [0.0] * n
    for f in sorted(files, key=lambda f: (-times.get(f, default), f)):
        i = loads.index(min(loads))
        parts[i].append(f)
        loads[i] += times.get(f, default)
    return parts


def file_of(item) -> str:
    return item.nodeid.split("::")[0]


def leave_out(config, items, keep_file) -> None:
    """Deselect (reported as such) the items of the files ``keep_file`` says no to."""
    keep = {f: keep_file(f) for f in {file_of(item) for item in items}}
    config.hook.pytest_deselected(items=[item for item in items if not keep[file_of(item)]])
    items[:] = [item for item in items if keep[file_of(item)]]


@pytest.hookimpl(trylast=True)  # after the markers have deselected theirs: every shard parts the same files
def pytest_collection_modifyitems(config, items):
    quick, spec = config.getoption("--quick"), config.getoption("--shard")
    if quick <= 0 and not spec:
        return
    with open(DURATIONS, encoding="utf-8") as fh:
        times = json.load(fh)
    if quick > 0:  # a file not recorded yet runs
        leave_out(config, items, lambda f: times.get(f, 0.0) <= quick)
    if not spec:
        return
    try:
        k, n = (int(x) for x in spec.split("/"))
        assert 1 <= k <= n
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"--shard {spec!r}: expected K/N with 1 <= K <= N") from None
    mine = set(shards(list(dict.fromkeys(file_of(item) for item in items)), times, n)[k - 1])
    leave_out(config, items, mine.__contains__)


_file_times: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = file_of(report)
    _file_times[path] = _file_times.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
    if not session.config.getoption("--record-durations") or not _file_times:
        return
    import fcntl
    with open(DURATIONS, "r+", encoding="utf-8") as fh:  # make test's halves write it at about the same time
        fcntl.flock(fh, fcntl.LOCK_EX)
        times = json.load(fh)
        times.update({f: round(t, 1) for f, t in _file_times.items() if t >= 0.05})
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(times, indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_basetemp(tmp_path_factory):
    """The temporary files of the tests and of the processes they start (node logs, ROS log directories,
    simulator worker logs) go under the session's base directory, which the next run replaces, rather than
    piling up in the system's temporary directory."""
    old = {k: os.environ.get(k) for k in ("TMPDIR", "RAY_TMPDIR")}
    # Ray's sessions (synflux-serve's local Ray) in a short dir of their own, removed at the end: their socket
    # paths must fit in the 107 bytes of an AF_UNIX path, which a deep base directory would pass
    os.environ["RAY_TMPDIR"] = ray_dir = tempfile.mkdtemp(prefix="synflux-ray-", dir="/tmp")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp", numbered=False))
    tempfile.tempdir = None  # tempfile caches the directory it chose
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    tempfile.tempdir = None
    shutil.rmtree(ray_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ros_env(tmp_path_factory):
    rclpy = pytest.importorskip("rclpy", reason="rclpy is not installed (run `make test`, which sets up .venv)")
    from synflux_ros.tools import harness as testing
    # One domain per test session; a ROS_DOMAIN_ID set by the caller is kept, never replaced.
    env = testing.ros_env(log_dir=str(tmp_path_factory.mktemp("roslog")))
    testing.use_env(env)
    rclpy.init()
    yield env
    rclpy.try_shutdown()


@pytest.fixture()
def client(ros_env):
    import rclpy
    node = rclpy.create_node(f"test_client_{uuid.uuid4().hex[:8]}")
    yield node
    node.destroy_node()


@pytest.fixture(scope="session")
def make_config(tmp_path_factory):
    """Write a variant of a shipped config: make_config('vlm_demo.yaml', session={'max_sessions': 2})."""
    from synflux_ros.tools import harness as testing
    def _make(base: str, **sections) -> str:
        with open(testing.config_path(base), encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
        for key, value in sections.items():
            if isinstance(value, dict):
                raw.setdefault(key, {}).update(value)
            else:
                raw[key] = value
        path = tmp_path_factory.mktemp("cfg") / os.path.basename(base)
        path.write_text(yaml.safe_dump(raw))
        return str(path)
    return _make


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the tail of each node's output (what the node logged is often the why)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for p in getattr(item, "synflux_nodes", []):
            state = "running" if p.alive() else f"exited with {p.proc.returncode}"
            report.sections.append((f"{p.name} output ({state})", p.output()[-4000:]))


@pytest.fixture()
def start_node(ros_env, request):
    """Start a node executable; every process is stopped (SIGINT) at the end of the test."""
    from synflux_ros.tools import harness as testing
    procs = []
    request.node.synflux_nodes = procs

    def _start(name, params=None, namespace=None, **kw):
        remaps = dict(kw.pop("remaps", {}))
        if namespace:
            remaps["__ns"] = namespace
        p = testing.NodeProcess(name, params=params, env=kw.pop("env", None) or ros_env, remaps=remaps, **kw)
        procs.append(p)
        return p
    yield _start
    running = [p.alive() for p in procs]
    # every process is stopped (together) before any is judged, so one failure leaves none running
    codes = testing.stop_all(procs)
    unclean = [f"{p.name} exited with {code} on SIGINT:\n{p.output()[-3000:]}"
               for p, was_running, code in zip(procs, running, codes)
               if was_running and code != 0]  # a node stopped with SIGINT must exit cleanly
    assert not unclean, "\n\n".join(unclean)


@pytest.fixture(scope="session")
def shipped_graphs(tmp_path_factory, demo_graphs):
    """``get(name)``: the graph set of the shipped config ``name`` (``vla_pi05.yaml``) shrunk to demo size
    (checkpoints.demo_size), exported once per session by synflux-build (random weights, seed 0); with a
    ``+vjp`` suffix the config runs Real-Time Chunking's vjp guidance (its vjp graphs added). The demo configs
    are ``demo_graphs``'. Tests that write into a set copy it first."""
    from synflux_ros.buildtool.export import build
    from synflux_ros.core.config import load_config
    from synflux_ros.tools import harness as testing
    from checkpoints import demo_size
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            base, _, extra = name.partition("+")
            if not extra and base.removesuffix(".yaml") in demo_graphs:
                built[name] = str(demo_graphs[base.removesuffix(".yaml")])
                return built[name]
            with open(testing.config_path(base), encoding="utf-8") as fh:
                raw = demo_size(yaml.safe_load(fh))
            if extra == "vjp":
                raw["execution"] = {"mode": "rtc", "rtc": {"guidance": "vjp"}}
            elif extra:
                raise ValueError(f"shipped_graphs: unknown suffix {extra!r} of {name!r}")
            d = tmp_path_factory.mktemp(base.removesuffix(".yaml") + (f"-{extra}" if extra else ""))
            (d / base).write_text(yaml.safe_dump(raw))
            build(load_config(str(d / base)), str(d / "graphs"))
            built[name] = str(d / "graphs")
        return built[name]
    return get


@pytest.fixture(scope="session")
def demo_graphs(tmp_path_factory):
    """The demo configs exported once by synflux-build (random weights): name -> graph set directory.
    Tests that change a graph set copy it first."""
    pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
    from synflux_ros.buildtool.export import build
    from synflux_ros.core.config import load_config
    from synflux_ros.tools import harness as testing
    out = {}
    for name in ("vla_demo_orin", "vlm_demo"):
        d = tmp_path_factory.mktemp(f"{name}_graphs")
        build(load_config(testing.config_path(f"{name}.yaml")), str(d))
        out[name] = d
    return out
