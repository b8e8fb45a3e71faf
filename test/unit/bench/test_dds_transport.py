"""The Fast DDS transport benchmark's bookkeeping: each side's environment, the probe's result line, the
delivery and latency figures and the table (the measurement itself is `make bench-dds`)."""
from __future__ import annotations

import pytest

from synflux_ros.bench import dds_transport as bench
from synflux_ros.nodes.ros_compat import fastdds_profile_variables

BASE = {"ROS_DOMAIN_ID": "150", "FASTDDS_DEFAULT_PROFILES_FILE": "/user/profile.xml",
        "FASTRTPS_DEFAULT_PROFILES_FILE": "/old.xml", "FASTDDS_BUILTIN_TRANSPORTS": "UDPv4", "PATH": "/bin"}


def test_each_side_gets_only_its_own_fast_dds_setting():
    plain = {"ROS_DOMAIN_ID": "150", "PATH": "/bin"}
    assert bench.side_env(BASE, "defaults", "/p.xml") == plain
    chosen = fastdds_profile_variables(plain)  # the variable(s) the installed Fast DDS reads
    assert bench.side_env(BASE, "profile", "/p.xml") == {**plain, **{v: "/p.xml" for v in chosen}}
    assert bench.side_env(BASE, "large_data", "/p.xml") == {**plain, "FASTDDS_BUILTIN_TRANSPORTS": "LARGE_DATA"}
    assert BASE["FASTDDS_BUILTIN_TRANSPORTS"] == "UDPv4"  # the caller's environment is left as it was
    with pytest.raises(ValueError, match="unknown Fast DDS setting 'udp'"):
        bench.side_env(BASE, "udp", "/p.xml")


def test_the_cases_cover_both_sides_of_each_setting():
    pairs = {(c.publisher, c.subscriber) for c in bench.CASES}
    assert {("defaults", "defaults"), ("profile", "profile"), ("defaults", "profile"),
            ("defaults", "large_data"), ("large_data", "large_data")} <= pairs
    reference = next(c for c in bench.CASES if c.key == bench.REFERENCE)
    assert (reference.publisher, reference.subscriber) == ("profile", "profile")


def test_result_line_is_the_last_json_object():
    text = 'ready\n[WARN] {not json\n{"received": 3, "partial": 0, "latency_ms": [1.0]}\n'
    assert bench.last_json(text, "subscriber")["received"] == 3
    with pytest.raises(RuntimeError, match="subscriber printed no result"):
        bench.last_json("ready\nTraceback ...\n", "subscriber")


def test_summary_counts_and_latency():
    s = bench.summarise(90, 45, [float(v) for v in range(1, 46)])
    assert s["delivered"] == 0.5 and s["median_ms"] == 23.0 and s["p90_ms"] == 41.0
    empty = bench.summarise(90, 0, [])
    assert empty["delivered"] == 0.0 and empty["median_ms"] is None and empty["p90_ms"] is None
    with pytest.raises(ValueError, match="91 frames received of 90"):
        bench.summarise(90, 91, [1.0] * 91)


def test_table_gives_ratios_against_the_profile_on_both_sides():
    results = {"448x448": {"a": bench.summarise(90, 9, [5.0] * 9), "b": bench.summarise(90, 90, [2.0] * 90),
                           "d": bench.summarise(90, 0, [])}}
    rows = {line.split(")")[0].split("(")[-1]: line for line in bench.table(results).splitlines()[1:]}
    assert set(rows) == {"a", "b", "d"}
    assert "9 of  90   0.10x" in rows["a"] and "90 of  90   1.00x" in rows["b"] and "0 of  90   0.00x" in rows["d"]
    assert "5.0 ms" in rows["a"] and rows["d"].count("- ms") == 2
