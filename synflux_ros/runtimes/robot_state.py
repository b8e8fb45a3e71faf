"""Robot state for the action expert: joint positions by name, matched to camera frames by header stamp.

``vla_node`` feeds every ``sensor_msgs/JointState`` it receives into a :class:`RobotStateBuffer` and asks it,
per camera frame, for the state at the frame's time. The buffer is ROS-free: stamps are seconds, names and
positions plain sequences.

Rules (``action.state_joints``, ``action.state_dim``, ``action.state_max_age``):

* a message must name every configured joint and carry a finite position for each (extra joints are
  ignored); otherwise it is refused with the reason, and the previous states stay;
* the state vector holds the configured joints' positions in config order, zero-padded to ``state_dim``;
* for a frame stamped ``t`` the newest state stamped at or before ``t`` is used; when every state is newer
  than the frame, the oldest one is; either way it must lie within ``state_max_age`` of ``t``, else the
  frame gets no state (:class:`NoFreshState` says how old the nearest one was).
"""
from __future__ import annotations

import bisect
import math
import threading

import numpy as np

from ..core.config import ActionConfig


class NoFreshState(LookupError):
    """No joint state within ``action.state_max_age`` of a frame; the message says what was there."""


class RobotStateBuffer:
    """The last ``capacity`` joint states, ordered by stamp; thread-safe."""

    def __init__(self, action: ActionConfig, capacity: int = 256):
        if not action.state_dim:
            raise ValueError("RobotStateBuffer needs action.state_dim > 0")
        self.joints = tuple(action.state_joints)
        self.dim = action.state_dim
        self.max_age = float(action.state_max_age)
        self.capacity = capacity
        self._stamps: list[float] = []
        self._states: list[np.ndarray] = []
        self._lock = threading.Lock()

    def add(self, stamp: float, names, positions) -> np.ndarray:
        """Store one joint-state message; returns its state vector. ValueError says why one is refused."""
        names, positions = list(names), list(positions)
        if len(positions) != len(names):
            raise ValueError(f"{len(names)} joint names but {len(positions)} positions")
        if not math.isfinite(stamp):
            raise ValueError(f"stamp {stamp!r} is not finite")
        index = {n: i for i, n in enumerate(names)}
        missing = [j for j in self.joints if j not in index]
        if missing:
            raise ValueError(f"joint{'s' if len(missing) > 1 else ''} {', '.join(repr(j) for j in missing)} "
                             f"missing (the message names {names[:8]}{' ...' if len(names) > 8 else ''})")
        state = np.zeros(self.dim, np.float32)
        for k, joint in enumerate(self.joints):
            value = float(positions[index[joint]])
            if not math.isfinite(value):
                raise ValueError(f"joint {joint!r}: position {value!r} is not finite")
            state[k] = value
        with self._lock:
            at = bisect.bisect_right(self._stamps, stamp)
            self._stamps.insert(at, stamp)
            self._states.insert(at, state)
            if len(self._stamps) > self.capacity:
                del self._stamps[0], self._states[0]
        return state

    def at(self, stamp: float) -> tuple[np.ndarray, float]:
        """(state vector, age in seconds: frame stamp minus state stamp, negative for a newer state) for a
        frame stamped ``stamp``; NoFreshState when none lies within ``state_max_age``."""
        with self._lock:
            if not self._stamps:
                raise NoFreshState("no joint state received yet on 'joint_states'")
            at = bisect.bisect_right(self._stamps, stamp)
            pick = at - 1 if at > 0 else 0
            age = stamp - self._stamps[pick]
            state = self._states[pick]
        if abs(age) > self.max_age:
            when = "older" if age > 0 else "newer"
            raise NoFreshState(f"the nearest joint state is {abs(age) * 1e3:.0f} ms {when} than the frame "
                               f"(action.state_max_age: {self.max_age * 1e3:.0f} ms)")
        return state.copy(), age
