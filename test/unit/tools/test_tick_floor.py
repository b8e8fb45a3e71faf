"""tools.tick_floor: the bare tick that bench.colocation runs beside vla_node's command thread; its figures, the
settings it takes (applied in its own process, or a warning naming what is missing) and the bad values it
refuses before a child starts."""
from __future__ import annotations

import os

import pytest

from synflux_ros.tools.colocation import floor_probe
from synflux_ros.tools.tick_floor import FloorProbe, cpu_times, measure


def test_the_loop_ticks_on_its_schedule_and_reports_its_lateness():
    r = measure(0.5, rate_hz=100.0)
    assert 40 <= r["ticks"] <= 52  # 50 on time; none fired twice, few lost to a busy machine
    assert 0.0 <= r["late_p99_ms"] <= r["late_max_ms"]
    assert r["ticks_late"] >= 0 and r["ticks_skipped"] >= 0
    assert 0.0 <= r["steal_share"] <= 1.0
    assert r["warning"] == ""


def test_the_machine_times_come_from_proc_stat():
    steal, total = cpu_times()
    if not os.path.exists("/proc/stat"):
        assert (steal, total) == (0, 0)
    else:
        assert 0 <= steal <= total and total > 0


@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling")
def test_a_probe_in_its_own_process_runs_on_the_cores_and_at_the_policy_given():
    last = (os.cpu_count() or 1) - 1
    probe = FloorProbe("fifo:10", str(last))
    probe.run_for(0.3)
    r = probe.result()
    assert r["cpus"] == [last]
    if r["warning"]:  # no CAP_SYS_NICE / rtprio here: said, and the loop ran at the policy it had
        assert "not permitted" in r["warning"] and "rtprio" in r["warning"]
        assert r["policy"] == os.SCHED_OTHER
    else:
        assert r["policy"] == os.SCHED_FIFO
    assert r["ticks"] >= 20


def test_bad_settings_are_refused_before_a_child_starts():
    with pytest.raises(ValueError, match="priority"):
        FloorProbe("fifo", "")
    with pytest.raises(ValueError, match="no core 4096"):
        FloorProbe("normal", "4096")
    with pytest.raises(ValueError, match="positive"):
        measure(0.0)


def test_the_bench_puts_its_probe_one_real_time_priority_below_the_command_thread_on_its_cores():
    assert floor_probe({"cpus": "0", "command_scheduling": "fifo:80"}).args[:4] == ["--scheduling", "fifo:79",
                                                                                      "--cpus", "0"]
    assert floor_probe({"cpus": "0-1", "command_cpus": "1", "command_scheduling": "rr:1"}).args[:4] == [
        "--scheduling", "rr:1", "--cpus", "1"]
    assert floor_probe({}).args[:4] == ["--scheduling", "normal", "--cpus", ""]
