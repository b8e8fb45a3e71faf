"""Robot state for the action expert: joint positions by name, matched to camera frames by header stamp;
and, for models with several cameras, the other cameras' images matched to the first camera's frames.

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
    """Nothing within the allowed age of a frame (a joint state, or another camera's image); the message
    says what was there."""


class StampedBuffer:
    """The last ``capacity`` values by header stamp (seconds), thread-safe; :meth:`at` finds the one for a
    frame's stamp. Shared by the joint states and the images of a frame's other cameras.

    ``nearest`` False (joint states): the newest value stamped at or before the frame, else the oldest one;
    True (camera images): the value with the stamp closest to the frame's. Either must lie within ``max_age``.
    ``what`` names the values in messages (e.g. ``"joint state"``), ``source`` where they come from,
    ``limit`` the setting behind ``max_age``."""

    def __init__(self, max_age: float, capacity: int, what: str, source: str, limit: str, nearest: bool = False):
        self.max_age = float(max_age)
        self.capacity = capacity
        self.what, self.source, self.limit, self.nearest = what, source, limit, nearest
        self._stamps: list[float] = []
        self._values: list = []
        self._lock = threading.Lock()

    def add(self, stamp: float, value) -> None:
        if not math.isfinite(stamp):
            raise ValueError(f"stamp {stamp!r} is not finite")
        with self._lock:
            at = bisect.bisect_right(self._stamps, stamp)
            self._stamps.insert(at, stamp)
            self._values.insert(at, value)
            if len(self._stamps) > self.capacity:
                del self._stamps[0], self._values[0]

    def at(self, stamp: float) -> tuple[object, float]:
        """(value, age in seconds: frame stamp minus value stamp, negative for a newer value) for a frame
        stamped ``stamp``; NoFreshState when none lies within ``max_age``."""
        with self._lock:
            if not self._stamps:
                raise NoFreshState(f"no {self.what} received yet on {self.source}")
            at = bisect.bisect_right(self._stamps, stamp)
            pick = at - 1 if at > 0 else 0
            if self.nearest and at < len(self._stamps) and (
                    at == 0 or self._stamps[at] - stamp < stamp - self._stamps[at - 1]):
                pick = at
            age = stamp - self._stamps[pick]
            value = self._values[pick]
        if abs(age) > self.max_age:
            when = "older" if age > 0 else "newer"
            raise NoFreshState(f"the nearest {self.what} is {abs(age) * 1e3:.0f} ms {when} than the frame "
                               f"({self.limit}: {self.max_age * 1e3:.0f} ms)")
        return value, age


class RobotStateBuffer:
    """The last ``capacity`` joint states, ordered by stamp; thread-safe."""

    def __init__(self, action: ActionConfig, capacity: int = 256):
        if not action.state_dim:
            raise ValueError("RobotStateBuffer needs action.state_dim > 0")
        self.joints = tuple(action.state_joints)
        self.dim = action.state_dim
        self._buffer = StampedBuffer(action.state_max_age, capacity, "joint state", "'joint_states'",
                                     "action.state_max_age")

    def add(self, stamp: float, names, positions) -> np.ndarray:
        """Store one joint-state message; returns its state vector. ValueError says why one is refused."""
        names, positions = list(names), list(positions)
        if len(positions) != len(names):
            raise ValueError(f"{len(names)} joint names but {len(positions)} positions")
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
        self._buffer.add(stamp, state)
        return state

    def at(self, stamp: float) -> tuple[np.ndarray, float]:
        """(state vector, age in seconds: frame stamp minus state stamp, negative for a newer state) for a
        frame stamped ``stamp``; NoFreshState when none lies within ``state_max_age``."""
        state, age = self._buffer.at(stamp)
        return state.copy(), age


class CameraImages:
    """The newest images of a frame's other cameras (``vision.cameras[1:]``): the first camera's frames
    trigger inference, and each takes, per other camera, the image whose stamp is nearest to its own,
    within ``vision.camera_max_skew``."""

    def __init__(self, cameras, max_skew: float, topic: str = "{}/image", capacity: int = 8):
        self.cameras = tuple(cameras)
        self._buffers = {name: StampedBuffer(max_skew, capacity, f"'{name}' image", repr(topic.format(name)),
                                             "vision.camera_max_skew", nearest=True) for name in self.cameras[1:]}

    def add(self, camera: str, stamp: float, image: np.ndarray) -> None:
        self._buffers[camera].add(stamp, image)

    def images_for(self, stamp: float, first: np.ndarray) -> list[np.ndarray]:
        """[first, image of camera 2, ...] for a first-camera frame stamped ``stamp``; NoFreshState names the
        camera without an image close enough."""
        return [first] + [self._buffers[name].at(stamp)[0] for name in self.cameras[1:]]
