"""core.sharing: the parameters' parsers, thread policies and core sets applied to real threads, the threads'
wait times, and the accelerator arbiter's order between two real processes."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from synflux_ros.core import sharing


def test_scheduling_specs_parse_and_bad_ones_say_what_is_wrong():
    assert sharing.parse_scheduling("") == sharing.Scheduling("normal", 0)
    assert sharing.parse_scheduling("fifo:80") == sharing.Scheduling("fifo", 80)
    assert sharing.parse_scheduling(" Normal:5 ") == sharing.Scheduling("normal", 5)
    assert str(sharing.parse_scheduling("idle")) == "idle"
    for bad, words in [("fifo", "priority 1..99"), ("fifo:0", "priority 1..99"), ("rr:120", "1..99"),
                       ("normal:40", "nice"), ("idle:3", "takes no number"), ("realtime", "one of"),
                       ("fifo:x", "not an integer")]:
        with pytest.raises(ValueError, match=words):
            sharing.parse_scheduling(bad)


def test_core_sets_parse_and_cores_the_machine_lacks_are_refused():
    assert sharing.parse_cpus("") == frozenset()
    assert sharing.parse_cpus("0") == sharing.parse_cpus(0) == sharing.parse_cpus([0]) == {0}
    n = os.cpu_count()
    assert sharing.parse_cpus(f"0-{n - 1}") == set(range(n))
    for bad, words in [("a", "not a core number"), ("3-1", "not a range"), (str(n), f"no core {n}"),
                       ("-1", "not a core number")]:
        with pytest.raises(ValueError, match=words):
            sharing.parse_cpus(bad)


def _in_thread(fn):
    out = {}

    def run():
        out["result"] = fn()
        out["tid"] = threading.get_native_id()
        out["policy"] = os.sched_getscheduler(0)
        out["param"] = os.sched_getparam(0).sched_priority
        out["cpus"] = os.sched_getaffinity(0)
        out["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_a_policy_and_a_core_set_are_applied_to_one_thread_and_others_keep_theirs():
    before = (os.sched_getscheduler(0), os.sched_getaffinity(0))
    out = _in_thread(lambda: sharing.apply_to_threads(sharing.Scheduling("idle"), frozenset({0}),
                                                      [threading.get_native_id()]))
    assert out["result"] is None
    assert out["policy"] == os.SCHED_IDLE and out["cpus"] == {0}
    assert (os.sched_getscheduler(0), os.sched_getaffinity(0)) == before  # the test's own thread untouched
    out = _in_thread(lambda: sharing.apply_to_threads(sharing.Scheduling("normal", 7), frozenset(),
                                                      [threading.get_native_id()]))
    assert out["result"] is None and out["policy"] == os.SCHED_OTHER and out["nice"] == 7


def test_real_time_where_permitted_and_a_clear_reason_where_not():
    if os.geteuid() == 0:
        out = _in_thread(lambda: sharing.apply_to_threads(sharing.Scheduling("fifo", 10), frozenset(),
                                                          [threading.get_native_id()]))
        if out["result"] is None:  # a container may still refuse root real-time scheduling
            assert out["policy"] == os.SCHED_FIFO and out["param"] == 10
    # an unprivileged process without an rtprio limit is refused, and told what it needs
    script = textwrap.dedent("""
        import os, resource, threading
        from synflux_ros.core import sharing
        resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)
        print(sharing.apply_to_threads(sharing.Scheduling("fifo", 80), frozenset(), [threading.get_native_id()]))
        print(os.sched_getscheduler(0) == os.SCHED_OTHER)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    reason, unchanged = out.stdout.strip().splitlines()
    assert "not permitted: fifo:80 needs CAP_SYS_NICE" in reason and "rtprio 80" in reason
    assert unchanged == "True"


def test_thread_times_count_the_time_a_thread_waits_for_a_busy_core():
    times = sharing.ThreadTimes()
    if not times.available:
        pytest.skip("this kernel keeps no per-thread schedstat")
    stop = time.monotonic() + 0.6

    def spin():
        os.sched_setaffinity(0, {0})
        while time.monotonic() < stop:
            pass
    threads = [threading.Thread(target=spin) for _ in range(3)]  # three threads on one core: each waits
    tids = []
    for t in threads:
        t.start()
    time.sleep(0.05)
    tids = [t.native_id for t in threads]
    run0, wait0 = times.sample(tids)
    for t in threads:
        t.join()
    run, wait = times.sample(tids)  # the ended threads keep what was counted last
    assert run >= run0 and wait >= wait0
    assert wait0 > 0.03, "three spinning threads on one core must have waited for it"


BACKGROUND = textwrap.dedent("""
    import sys, time
    from synflux_ros.core.sharing import Arbiter
    arbiter = Arbiter(sys.argv[1], "background")
    gate = arbiter.gate()
    call_s, until = float(sys.argv[2]), time.monotonic() + float(sys.argv[3])
    print("ready", flush=True)
    while time.monotonic() < until:
        with gate:
            t0 = time.monotonic()
            while time.monotonic() - t0 < call_s:   # a graph call: busy, cannot be cut short
                pass
            t1 = time.monotonic()
        print(f"{t0:.6f} {t1:.6f}", flush=True)
""")


@pytest.mark.parametrize("exclusive", [True, False])
def test_a_frame_waits_for_at_most_the_running_background_call_and_none_starts_while_it_runs(tmp_path, exclusive):
    path = str(tmp_path / "arbiter")
    call_s = 0.03
    proc = subprocess.Popen([sys.executable, "-c", BACKGROUND, path, str(call_s), "4"], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        arbiter = sharing.Arbiter(path, "control", exclusive=exclusive)
        frames = []
        for i in range(25):
            time.sleep(0.013 * (i % 5 + 1))
            t_ask = time.monotonic()
            arbiter.enter()
            t_in = time.monotonic()
            time.sleep(0.02)  # the frame's work
            t_out = time.monotonic()
            arbiter.leave()
            frames.append((t_ask, t_in, t_out))
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    calls = [tuple(map(float, line.split())) for line in out.strip().splitlines()]
    assert len(calls) > 20
    # Checked by the order of events, not by how long a wait took: on a loaded machine a process wakes late.
    entered_during_a_call = 0
    for t_ask, t_in, t_out in frames:
        # no background call starts while a frame holds the arbiter
        assert not [c for c in calls if t_in < c[0] < t_out], (t_in, t_out)
        # a frame waits for at most one call: the one running when it asked, or one that had just taken its turn
        assert len([c for c in calls if c[0] < t_in and c[1] > t_ask]) <= 1, (t_ask, t_in)
        if exclusive:
            assert not [c for c in calls if c[0] < t_in < c[1]], "a call ran on when the frame started"
        else:
            entered_during_a_call += bool([c for c in calls if c[0] < t_in < c[1]])
    if exclusive:
        assert arbiter.waits > 0  # frames did ask while a call ran, and waited for it
    else:
        assert entered_during_a_call > 0  # holds the next calls off, waits for none
    # the shared count saw every call, and what the node reports agrees with the order of events
    assert arbiter._calls_started() == len(calls)
    assert arbiter.max_passed <= 1
    arbiter.close()


def test_the_arbiter_is_released_when_its_holder_dies(tmp_path):
    path = str(tmp_path / "arbiter")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from synflux_ros.core.sharing import Arbiter
        a = Arbiter({path!r}, "control"); a.enter(); print("held", flush=True); time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    background = sharing.Arbiter(path, "background")
    done = threading.Event()

    def call():
        with background.gate():
            done.set()
    t = threading.Thread(target=call, daemon=True)
    t.start()
    assert not done.wait(0.3), "a background call ran while the control side held the arbiter"
    holder.kill()
    holder.wait()
    assert done.wait(5), "the arbiter stayed held after its holder died"
    assert background.waits == 1 and background.wait_s >= 0.3


def test_the_arbiter_refuses_a_bad_role_or_directory_and_an_unmatched_leave(tmp_path):
    with pytest.raises(ValueError, match="role"):
        sharing.Arbiter(str(tmp_path / "a"), "vla")
    with pytest.raises(ValueError, match="no directory"):
        sharing.Arbiter(str(tmp_path / "missing" / "a"), "control")
    a = sharing.Arbiter(str(tmp_path / "a"), "control")
    with pytest.raises(RuntimeError, match="without enter"):
        a.leave()
    a.enter()
    a.enter()  # overlapping frames: held once, released by the last
    a.leave()
    a.leave()
    a.close()
