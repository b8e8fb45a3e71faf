"""The frame ledger of a VLA node, ROS-free: every camera frame counted in exactly one outcome, the receive
and camera rates, latencies and publish rate, and the health verdict the node's ``/diagnostics`` reports.

Times come in as seconds, so the ledger runs (and is tested) without rclpy: a frame's receipt is recorded on
the steady clock (for the silence since the last frame) and on the node's clock (for the receive rate: it is
simulated time under ``use_sim_time``), with the frame's header stamp (for the camera's own rate).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from ..core.pipeline import PipelineCounters, source_rate

OK, WARN, ERROR = 0, 1, 2
"""Health levels, numbered as diagnostic_msgs/DiagnosticStatus numbers them."""

SKIPPED = ("rejected", "inactive", "no_state", "no_camera", "not_needed")
"""Outcomes of a frame that never reaches the pipeline: its image refused, received while inactive, no fresh
robot state, no image of every other camera close enough, not needed (``execution.request: threshold``)."""
PIPELINE_OUTCOMES = {"published": "processed", "dropped": "dropped", "failed": "failed"}
"""Outcomes the pipeline counts: outcome -> the name of its :class:`PipelineCounters` field."""
OUTCOMES = SKIPPED + tuple(PIPELINE_OUTCOMES)
"""Where a received frame ends; until it does it is in flight (inside the pipeline)."""
INPUTS = ("instructions_rejected", "states_received", "states_rejected", "camera_images", "camera_images_rejected")
"""The node's other inputs, counted alongside the frames."""

RATE_WINDOW = 120
"""Frames over which the receive and camera rates are estimated."""
RECENT = 200
"""Published chunks over which the latency and the publish rate are taken."""
MIN_DELIVERY_RATIO = 0.9
"""Below this share of the camera's frames received, the verdict warns of transport loss."""
CAMERA_RATE_TOLERANCE = 0.2
"""A stated camera rate this far (relative) from the one the stamps show is called out."""
NO_FRAME_PERIODS = 10
"""With a stated camera rate: no frame for this many camera periods (at least NO_FRAME_MIN_S) is an ERROR."""
NO_FRAME_MIN_S = 2.0


@dataclass(frozen=True)
class Health:
    """The verdict on a node's frames: a level and the problems behind it, worst last."""
    level: int
    problems: tuple[str, ...]

    def message(self, publish_rate_hz: float) -> str:
        """The one line of ``/diagnostics``: the publish rate, then the problems."""
        return ", ".join([f"{publish_rate_hz:.1f} Hz", *self.problems])


class FrameLedger:
    """Counts, rates and latencies of a node's camera frames; thread-safe (callbacks and pipeline threads).

    Frames are counted here until they reach the pipeline and by the pipeline after that: :meth:`counts`
    takes the live pipeline's counters, and :meth:`retire` keeps those of a pipeline torn down.
    ``camera_rate`` is the camera's stated rate in Hz (0: not stated, estimated from the stamps).
    """

    def __init__(self, camera_rate: float = 0.0, transport_hint: str = ""):
        self.camera_rate = float(camera_rate)
        self.transport_hint = transport_hint
        self.active_since = 0.0
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("received", *SKIPPED, *INPUTS), 0)
        self._retired = dict.fromkeys(PIPELINE_OUTCOMES, 0)
        self._arrivals = deque(maxlen=RATE_WINDOW)  # (receipt on the steady clock, on the node's clock, stamp)
        self._latencies = deque(maxlen=RECENT)
        self._published = deque(maxlen=RECENT)  # steady clock

    # ---------------------------------------------------------------- recording
    def activate(self, now: float) -> None:
        """Frames are expected from ``now`` (steady clock): the silence counts from here before the first."""
        self.active_since = now

    def receive(self, now: float, clock: float, stamp: float) -> None:
        """A frame of the first camera arrived at ``now`` (steady clock) = ``clock`` (the node's clock),
        stamped ``stamp`` (its header, seconds)."""
        with self._lock:
            self._counts["received"] += 1
            self._arrivals.append((now, clock, stamp))

    def count(self, key: str, n: int = 1) -> None:
        """``n`` more of ``key``: a skip outcome (:data:`SKIPPED`) or another input (:data:`INPUTS`)."""
        if key not in self._counts or key == "received":
            raise KeyError(f"{key!r} is not counted by the node: one of {SKIPPED + INPUTS}")
        with self._lock:
            self._counts[key] += n

    def retire(self, counters: PipelineCounters) -> None:
        """Keep the outcomes of a pipeline torn down (its frames stay counted)."""
        with self._lock:
            for outcome, field in PIPELINE_OUTCOMES.items():
                self._retired[outcome] += getattr(counters, field)

    def published(self, latency_ms: float, now: float) -> None:
        """A chunk published at ``now`` (steady clock), ``latency_ms`` after its frame's receipt."""
        with self._lock:
            self._latencies.append(latency_ms)
            self._published.append(now)

    # ---------------------------------------------------------------- reading
    def counts(self, pipeline: PipelineCounters | None = None) -> dict[str, int]:
        """Every received frame is in exactly one of :data:`OUTCOMES` or ``in_flight``; with the other
        inputs' counts. ``pipeline``: the live pipeline's counters (None without one)."""
        with self._lock:
            counts = dict(self._counts)
            done = dict(self._retired)
        if pipeline is not None:
            for outcome, field in PIPELINE_OUTCOMES.items():
                done[outcome] += getattr(pipeline, field)
        counts.update(done)
        counts["in_flight"] = counts["received"] - sum(counts[k] for k in OUTCOMES)
        return counts

    def rates(self) -> dict[str, float]:
        """Receive rate against the camera's rate, stated or estimated from the header stamps of the frames
        that arrived (:func:`source_rate`), so frames lost before the node show as ``delivery_ratio`` < 1."""
        with self._lock:
            arrivals = list(self._arrivals)
        out = {"receive_rate_hz": 0.0, "camera_rate_hz": self.camera_rate, "delivery_ratio": 1.0,
               "estimated_camera_rate_hz": 0.0}
        if len(arrivals) < 3:
            return out
        span = arrivals[-1][1] - arrivals[0][1]  # on the node's clock: simulated time with use_sim_time
        if span > 0:
            out["receive_rate_hz"] = (len(arrivals) - 1) / span
        estimate, ratio = source_rate(s for _, _, s in arrivals)
        out["estimated_camera_rate_hz"] = estimate
        if self.camera_rate > 0:  # stated: frames that never arrive count too
            out["delivery_ratio"] = min(1.0, out["receive_rate_hz"] / self.camera_rate)
        else:
            out["camera_rate_hz"], out["delivery_ratio"] = estimate, ratio
        return out

    def silence(self, now: float) -> float:
        """Seconds since the last frame (or since :meth:`activate`, before the first) at ``now`` (steady)."""
        with self._lock:
            last = self._arrivals[-1][0] if self._arrivals else None
        return now - max(last or 0.0, self.active_since)

    def latencies(self) -> list[float]:
        """The latencies (ms, receipt to publish) of the recent chunks."""
        with self._lock:
            return list(self._latencies)

    def publish_rate(self) -> float:
        """Chunks per second over the recent ones (steady clock); 0.0 before two."""
        with self._lock:
            times = list(self._published)
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0

    def health(self, counts: dict[str, int], rates: dict[str, float], silence: float, topic: str = "image",
               problems=()) -> Health:
        """The verdict on ``counts`` (:meth:`counts`), ``rates`` (:meth:`rates`) and ``silence``: WARN for
        frames lost or refused on the way and for a camera rate not stated or not matching the stamps, ERROR
        for no frame on ``topic`` for long. ``problems`` found elsewhere come first and warn too."""
        problems = list(problems)
        if counts["rejected"] or counts["failed"]:
            problems.append(f"{counts['rejected']} rejected, {counts['failed']} failed")
        if counts["no_state"]:
            problems.append(f"{counts['no_state']} skipped without a fresh joint state")
        if counts["no_camera"]:
            problems.append(f"{counts['no_camera']} skipped without an image of every camera")
        if counts["camera_images_rejected"]:
            problems.append(f"{counts['camera_images_rejected']} camera images rejected")
        if counts["states_rejected"]:
            problems.append(f"{counts['states_rejected']} joint states rejected")
        level = WARN if problems else OK
        hint = self.transport_hint
        if rates["delivery_ratio"] < MIN_DELIVERY_RATIO:
            problems.append(f"receiving {rates['delivery_ratio']:.0%} of the camera's "
                            f"{rates['camera_rate_hz']:.1f} Hz: frames are lost in transport ({hint})")
            level = WARN
        stated, estimated = self.camera_rate, rates["estimated_camera_rate_hz"]
        if stated <= 0:
            problems.append("camera_rate_hz not set: frames lost before this node cannot be counted")
            level = WARN
        elif estimated and abs(estimated / stated - 1) > CAMERA_RATE_TOLERANCE:
            problems.append(f"the frames' stamps say {estimated:.1f} Hz, camera_rate_hz says {stated:g}: "
                            f"check the parameter")
            level = WARN
        if stated > 0 and silence > max(NO_FRAME_MIN_S, NO_FRAME_PERIODS / stated):
            problems.append(f"no camera frame for {silence:.1f} s on {topic} (is the camera publishing? {hint})")
            level = ERROR
        return Health(level, tuple(problems))
