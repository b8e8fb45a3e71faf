"""Header stamps and durations as seconds, and back: the one conversion the nodes share.

The ROS-free rooms take times as float seconds; a ``builtin_interfaces`` Time or Duration is (sec, nanosec).
"""
from __future__ import annotations

from builtin_interfaces.msg import Duration, Time


def stamp_seconds(stamp) -> float:
    """A Time (or Duration) message in seconds."""
    return stamp.sec + stamp.nanosec * 1e-9


def to_stamp(seconds: float, kind=Time):
    """``seconds`` as a message of ``kind`` (Time, or Duration), rounded to the nanosecond."""
    sec, nanosec = divmod(int(round(seconds * 1e9)), 10**9)
    return kind(sec=sec, nanosec=nanosec)


def to_duration(seconds: float) -> Duration:
    """``seconds`` (>= 0) as a Duration message, rounded to the nanosecond."""
    return to_stamp(seconds, Duration)
