"""Header stamps to seconds and back (synflux_ros.nodes.stamps)."""
from __future__ import annotations

import pytest
from builtin_interfaces.msg import Duration, Time

from synflux_ros.nodes.stamps import stamp_seconds, to_duration, to_stamp


@pytest.mark.parametrize("seconds", [0.0, 1e-9, 0.5, 100.1, 1_764_300_000.123456789, 2.9999999996])
def test_seconds_travel_as_a_stamp_to_the_nanosecond(seconds):
    stamp = to_stamp(seconds)
    assert isinstance(stamp, Time) and 0 <= stamp.nanosec < 10**9
    assert stamp.sec * 10**9 + stamp.nanosec == round(seconds * 1e9)
    assert stamp_seconds(stamp) == pytest.approx(seconds, rel=1e-15, abs=0.5e-9)  # to the nanosecond


def test_a_time_s_nanoseconds_are_a_fraction_of_its_second():
    assert stamp_seconds(Time(sec=100, nanosec=250_000_000)) == 100.25
    assert (to_stamp(100.25).sec, to_stamp(100.25).nanosec) == (100, 250_000_000)


def test_a_duration_rounds_up_into_the_next_second_rather_than_past_a_billion_nanoseconds():
    d = to_duration(0.9999999999)
    assert isinstance(d, Duration) and (d.sec, d.nanosec) == (1, 0)
    assert stamp_seconds(to_duration(1.5)) == 1.5
