"""The planner mode of the VLM node: every ``planner_period`` seconds the chat model is asked for the next subtask
towards a goal, with the latest camera frame, and the answer is published as vla_node's instruction.

:class:`PlannerMode` is a part of :class:`~synflux_ros.nodes.vlm_node.VLMNode` kept apart: it uses the node's
``runtime``, ``cfg``, ``_active`` and ``_serving`` (the lock every use of the model holds); the node calls
:meth:`_setup_planner` at configure, :meth:`_start_planner` at activation, :meth:`_destroy_planner` at cleanup
and :meth:`_planner_diagnostics` with its ``/diagnostics``. Off (``planner_period: 0``, the default), the node
has none of these topics. The text side (goal checks, the prompt, the subtask in a reply) is ROS-free, in
:mod:`..runtimes.planner`; docs/ros-interfaces.md ("Planner mode") describes the mode.
"""
from __future__ import annotations

import math
import threading
import time
import traceback

from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image
from std_msgs.msg import String

from ..model.image import ImageError, decode_raw
from ..runtimes.planner import DEFAULT_PROMPT, check_prompt_template, goal_text, planner_prompt, subtask_from_reply
from ..runtimes.remote import RemoteError
from ..runtimes.sessions import RequestError
from ..runtimes.vlm import ChatRequest
from .diagnostics import ros_text
from .lifecycle import destroy_entities
from .params import Param

PLANNER_PARAMS = [
    Param("planner_period", 0.0, "seconds between the planner's questions: the next subtask towards the goal on "
                                 "'goal', asked with the latest frame on 'image' and published on 'instruction' "
                                 "(0 = off; else at least 0.1)"),
    Param("planner_goal", "", "goal the planner uses until one arrives on 'goal' (empty = none: nothing is asked "
                              "before one arrives)"),
    Param("planner_prompt", DEFAULT_PROMPT, "the planner's question to the model; {goal} is replaced by the goal"),
    Param("planner_max_new_tokens", 32, "longest answer of the planner, in tokens (1 to 256)"),
]

PLANNER_SESSION = "_planner"
"""The planner's chat session: reset on every question, so its KV cache holds one question and its answer. While
the planner is on, it holds one of the config's session.max_sessions and the chat services refuse this id."""
MIN_PLANNER_PERIOD_S = 0.1
MAX_PLANNER_TOKENS = 256

# The goal, like vla_node's instruction, from volatile (`ros2 topic pub`) and latched publishers both; the
# subtask is published latched: it matches both of vla_node's instruction subscriptions, and a vla_node that
# starts later still gets the current subtask. test/unit/nodes/test_vlm_planner.py holds these to vla_node's.
GOAL_QOS = (
    QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.VOLATILE),
    QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL),
)
SUBTASK_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)

_COUNTERS = ("requests", "published", "unchanged", "empty_answers", "failed", "busy", "no_goal", "no_image",
             "goals_rejected", "images_rejected")


class PlannerMode:
    """The planner of a VLM node; see the module docstring."""

    _planner_period = 0.0
    _planner_timer = None

    def _init_planner(self) -> None:
        self._planner_lock = threading.Lock()  # the goal, the latest frame and the counters
        self._planner_subs, self._planner_pubs = [], {}
        self._planner_counts = dict.fromkeys(_COUNTERS, 0)  # kept over cleanups: the counts go on
        self._goal = ""
        self._frame = None  # the latest Image message, decoded when a question uses it
        self._last_subtask = ""  # the last subtask answered
        self._sent_subtask = ""  # the last one published: an unchanged subtask is not published again
        self._last_latency_ms = 0.0
        self._planner_error = ""

    # ---------------------------------------------------------------- lifecycle
    def _setup_planner(self, p: dict, cfg) -> str:
        """Check the planner's parameters; with the planner on, its topics and timer. Returns a summary ("" off)."""
        period = p["planner_period"]
        if isinstance(period, bool) or not isinstance(period, (int, float)) or not math.isfinite(period) or \
                not (period == 0 or period >= MIN_PLANNER_PERIOD_S):
            raise self.fail("planner_period", f"must be 0 (off) or a number of seconds >= {MIN_PLANNER_PERIOD_S}, "
                                              f"got {period!r}")
        self._planner_period = float(period)
        if not period:
            return ""
        if cfg.vision is None:
            raise self.fail("planner_period", f"the planner asks with camera frames, but {cfg.name!r} is a "
                                              f"text-only model (its config has no vision section)")
        try:
            self._template = check_prompt_template(p["planner_prompt"])
        except ValueError as exc:
            raise self.fail("planner_prompt", str(exc)) from None
        tokens = p["planner_max_new_tokens"]
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_PLANNER_TOKENS:
            raise self.fail("planner_max_new_tokens", f"must be an integer from 1 to {MAX_PLANNER_TOKENS}, "
                                                      f"got {tokens!r}")
        self._planner_tokens = tokens
        goal = ""
        if p["planner_goal"]:
            try:
                goal = self._checked_goal(p["planner_goal"])
            except ValueError as exc:
                raise self.fail("planner_goal", str(exc)) from None
        with self._planner_lock:
            self._goal, self._frame, self._sent_subtask = goal, None, ""
        inputs = MutuallyExclusiveCallbackGroup()
        self._planner_subs.append(self.create_subscription(Image, "image", self._on_planner_image,
                                                           qos_profile_sensor_data, callback_group=inputs))
        for qos in GOAL_QOS:
            self._planner_subs.append(self.create_subscription(String, "goal", self._on_goal, qos,
                                                               callback_group=inputs))
        self._planner_pubs["subtask"] = self.create_lifecycle_publisher(String, "instruction", SUBTASK_QOS)
        # On the steady clock, as diagnostics: a simulation's clock standing still does not stop the planner.
        self._planner_timer = self.create_timer(self._planner_period, self._on_planner_tick,
                                                callback_group=MutuallyExclusiveCallbackGroup(),
                                                clock=Clock(clock_type=ClockType.STEADY_TIME))
        return f", planner every {self._planner_period:g} s (goal {goal!r})"

    def _start_planner(self) -> None:
        """At activation: the first subtask answered is published whatever was published before."""
        with self._planner_lock:
            self._sent_subtask = ""

    def _destroy_planner(self) -> None:
        """At cleanup, once no question is in flight (the caller holds or has passed ``_serving``)."""
        if self._planner_timer is not None:
            self.destroy_timer(self._planner_timer)
            self._planner_timer = None
        destroy_entities(self, self._planner_subs, self._planner_pubs)
        self._planner_period = 0.0

    @property
    def planner_on(self) -> bool:
        return self._planner_period > 0

    # ---------------------------------------------------------------- inputs
    def _checked_goal(self, text) -> str:
        """A goal stripped, after the checks of a question that cost nothing; ValueError says why not."""
        goal = goal_text(text)
        runtime = self.runtime
        if runtime is None:  # a goal that arrived while a cleanup freed the model
            raise ValueError("the node is not configured")
        runtime.check_limits(PLANNER_SESSION, planner_prompt(self._template, goal), 1)  # RequestError
        return goal

    def _count(self, what: str, error: str = "") -> None:
        with self._planner_lock:
            self._planner_counts[what] += 1
            if error:
                self._planner_error = error

    def _on_goal(self, msg: String) -> None:
        try:
            goal = self._checked_goal(msg.data)
        except ValueError as exc:  # RequestError is one
            self._count("goals_rejected", f"goal: {exc}")
            self.get_logger().warning(f"planner goal rejected, keeping {self._goal!r}: {exc}")
            return
        with self._planner_lock:
            if goal == self._goal:  # a latched publisher matches both subscriptions: its goal can come twice
                return
            self._goal = goal
        self.get_logger().info(f"planner goal: {goal!r}")

    def _on_planner_image(self, msg: Image) -> None:
        with self._planner_lock:
            self._frame = msg

    # ---------------------------------------------------------------- questions
    def _on_planner_tick(self) -> None:
        if not self._active:
            return
        with self._planner_lock:
            goal, frame = self._goal, self._frame
        if not goal:
            self._count("no_goal")
            return
        if frame is None:
            self._count("no_image")
            return
        # A chat turn in progress comes first: the planner asks at its next period (counted as busy).
        if not self._serving.acquire(blocking=False):
            self._count("busy")
            return
        try:
            if self._active:  # a cleanup may have run while this tick waited
                self._ask(goal, frame)
        finally:
            self._serving.release()

    def _ask(self, goal: str, frame: Image) -> None:
        """One question and its answer; the caller holds ``_serving``."""
        log = self.get_logger()
        try:
            image = decode_raw(frame.encoding, frame.height, frame.width, frame.step, frame.data, frame.is_bigendian,
                               max_pixels=self.cfg.vision.max_input_pixels)
        except ImageError as exc:
            with self._planner_lock:
                if self._frame is frame:  # said once: the planner waits for the next frame
                    self._frame = None
            self._count("images_rejected", f"image: {exc}")
            log.warning(f"planner image rejected: {exc}")
            return
        self._count("requests")
        request = ChatRequest(PLANNER_SESSION, planner_prompt(self._template, goal), [image], reset=True,
                              max_new_tokens=self._planner_tokens, temperature=0.0)
        t0 = time.perf_counter()
        try:
            result = self.runtime.chat(request)
        except (RequestError, RemoteError) as exc:
            self._count("failed", f"question refused: {exc}")
            log.error(f"planner: goal {goal!r}: the question was refused: {exc}")
            return
        except Exception as exc:  # keep planning and serving; say what happened
            self._count("failed", f"internal error: {type(exc).__name__}: {exc}")
            log.error(f"planner: goal {goal!r}: the question failed: {exc}\n{traceback.format_exc()}")
            return
        latency = (time.perf_counter() - t0) * 1e3
        if result.evicted_session:
            log.info(f"session {result.evicted_session!r} evicted (least recently used) for the planner")
        subtask = subtask_from_reply(result.reply)
        with self._planner_lock:
            self._last_latency_ms = latency
            if not subtask:
                self._planner_counts["empty_answers"] += 1
                self._planner_error = f"no subtask in the answer {result.reply[:200]!r}"
            else:
                self._last_subtask = subtask
                send = subtask != self._sent_subtask
                self._planner_counts["published" if send else "unchanged"] += 1
                if send:
                    self._sent_subtask = subtask
        if not subtask:
            log.info(f"planner: goal {goal!r} -> no subtask in the answer {result.reply[:200]!r} "
                     f"({latency:.0f} ms), nothing published")
            return
        if send:
            self._planner_pubs["subtask"].publish(String(data=ros_text(subtask)))
        log.info(f"planner: goal {goal!r} -> subtask {subtask!r} ({latency:.0f} ms, "
                 f"{'published' if send else 'unchanged, not published again'})")

    # ---------------------------------------------------------------- diagnostics
    def _planner_diagnostics(self) -> dict:
        with self._planner_lock:
            values = {f"planner_{k}": v for k, v in self._planner_counts.items()}
            values.update(planner_goal=self._goal, planner_last_subtask=self._last_subtask,
                          planner_last_latency_ms=self._last_latency_ms, planner_last_error=self._planner_error)
        return values
