"""``execution``: how a VLA's action chunks become commands on the robot's clock (the modes, ``limits``,
``validate`` and ``rtc``); ``execution/`` runs what these sections describe."""
from __future__ import annotations

from dataclasses import dataclass

from .schema import ConfigError, setting


EXECUTION_MODES = ("auto", "replace", "rtc", "weighted_average", "average", "conservative", "latest_only",
                   "temporal_ensemble")
"""``execution.mode``: the merge functions are ``execution/merge.py``'s table, one per name but ``auto``."""
GUIDED_MODES = frozenset({"rtc"})
"""Modes whose plan steers the next inference (Real-Time Chunking): ``ExecutionConfig.guides_inference``."""


@dataclass(frozen=True, kw_only=True)
class LimitsConfig:
    """``execution.limits``: what no command may exceed, per joint in ``execution.joints`` order (empty = no
    such limit). Units are the joints' (rad or m for positions)."""
    _RELATIVE_ERRORS = True
    position_min: tuple[float, ...] = setting(default_factory=tuple, doc="lowest position per joint")
    position_max: tuple[float, ...] = setting(default_factory=tuple, doc="highest position per joint")
    max_velocity: tuple[float, ...] = setting(default_factory=tuple, doc="largest speed per joint (units/s) "
                                                                          "between two commands")
    max_acceleration: tuple[float, ...] = setting(default_factory=tuple, doc="largest change of speed per joint "
                                                                              "(units/s^2) between two commands")
    max_deceleration: tuple[float, ...] = setting(
        default_factory=tuple, doc="largest slowing down per joint (units/s^2); empty = max_acceleration. The "
                                   "command brakes at this rate in time to stop at a position limit")
    max_jerk: tuple[float, ...] = setting(
        default_factory=tuple, doc="largest change of acceleration per joint (units/s^3) between two commands; "
                                   "empty = none. The lowest priority: braking in time for a limit overrides it")
    max_relative_target: tuple[float, ...] = setting(
        default_factory=tuple, doc="largest distance of a command from the measured joint position (LeRobot's "
                                   "max_relative_target): one value for every joint, or one per joint")
    outside_at_enable: str = setting("refuse", choices=("refuse", "move_inside"),
                                      doc="a joint measured outside its position limits when commands are enabled: "
                                          "refuse to enable, naming it (default), or start there and move inside "
                                          "within the velocity and acceleration limits")

    PER_JOINT = ("position_min", "position_max", "max_velocity", "max_acceleration", "max_deceleration",
                 "max_jerk")

    def check(self, joints: tuple[str, ...]) -> None:
        """ConfigError naming the field and the joint when the limits do not fit ``joints`` or contradict."""
        for name in self.PER_JOINT:
            v = getattr(self, name)
            if v and len(v) != len(joints):
                raise ConfigError(f"limits.{name}: {len(v)} values for {len(joints)} joints {list(joints)}")
            for i, value in enumerate(v):
                if value != value:  # NaN passes every comparison below
                    raise ConfigError(f"limits.{name}[{i}] ({joints[i]}): NaN")
        if bool(self.position_min) != bool(self.position_max):
            raise ConfigError("limits.position_min / position_max: give both or neither")
        for i, joint in enumerate(joints):
            if self.position_min and not self.position_min[i] < self.position_max[i]:
                raise ConfigError(f"limits: joint {joint!r} has position_min {self.position_min[i]} not below "
                                  f"position_max {self.position_max[i]}")
            for name in ("max_velocity", "max_acceleration", "max_deceleration", "max_jerk"):
                v = getattr(self, name)
                if v and not v[i] > 0:
                    raise ConfigError(f"limits.{name}: joint {joint!r} has {v[i]}, a limit must be above 0")
        if self.max_jerk and not self.max_acceleration:
            raise ConfigError("limits.max_jerk: give max_acceleration too (the jerk limits how fast the "
                              "acceleration changes, up to max_acceleration)")
        r = self.max_relative_target
        if r and len(r) not in (1, len(joints)):
            raise ConfigError(f"limits.max_relative_target: {len(r)} values, give 1 or one per joint "
                              f"({len(joints)})")
        for i, value in enumerate(r):
            if not value > 0:
                joint = joints[i] if len(r) > 1 else "every joint"
                if value != value:
                    raise ConfigError(f"limits.max_relative_target[{i}] ({joint}): NaN")
                raise ConfigError(f"limits.max_relative_target: {joint!r} has {value}, a limit must be above 0")


@dataclass(frozen=True, kw_only=True)
class ChunkValidation:
    """``execution.validate``: a whole chunk checked before it enters the plan (LeRobot #4240), from its steps
    ``step_period`` apart: one value for every joint, or one per joint; empty = not checked."""
    max_step: tuple[float, ...] = setting(default_factory=tuple, doc="largest change between two steps (units)")
    max_velocity: tuple[float, ...] = setting(default_factory=tuple, doc="units/s between two steps")
    max_acceleration: tuple[float, ...] = setting(default_factory=tuple, doc="units/s^2 over three steps")
    max_jerk: tuple[float, ...] = setting(default_factory=tuple, doc="units/s^3 over four steps")
    on_violation: str = setting("refuse", choices=("refuse", "clip"),
                                 doc="refuse the chunk (counted, the worst joint and step in the warning), or clip "
                                     "its steps to max_step and max_velocity (acceleration and jerk still refuse)")

    FIELDS = ("max_step", "max_velocity", "max_acceleration", "max_jerk")

    def check(self, joints: tuple[str, ...]) -> None:
        for name in self.FIELDS:
            v = getattr(self, name)
            if v and len(v) not in (1, len(joints)):
                raise ConfigError(f"validate.{name}: {len(v)} values, give 1 or one per joint ({len(joints)})")
            for i, value in enumerate(v):
                if not value > 0:  # NaN too
                    who = joints[i] if len(v) > 1 else "every joint"
                    raise ConfigError(f"validate.{name}[{i}] ({who}): {value}, a threshold must be above 0")


@dataclass(frozen=True, kw_only=True)
class RTCConfig:
    """``execution.rtc``: Real-Time Chunking of flow-matching heads (Black et al. 2025)."""
    guidance: str = setting("lerobot", choices=("lerobot", "vjp"),
                             doc="lerobot: LeRobot's own (pi0 family: the weighted error; GR00T: the leftover "
                                 "written over the first rows, their velocity ramped); vjp: the paper's "
                                 "vector-Jacobian product through the action expert")
    schedule: str = setting("linear", choices=("zeros", "ones", "linear", "exp"),
                             doc="prefix weights over the previous chunk's leftover")
    execution_horizon: int = setting(10, min=1, doc="steps of the previous chunk that guide the new one")
    max_guidance_weight: float = setting(10.0, min=1e-6, doc="clamp of the guidance weight (> 0)")


@dataclass(frozen=True, kw_only=True)
class ExecutionConfig:
    """``execution``: how action chunks become commands on the robot's clock (vla configs). Without
    ``joints`` the node publishes action chunks only."""
    _RELATIVE_ERRORS = True
    joints: tuple[str, ...] = setting(default_factory=tuple, doc="commanded joints in action order, one per "
                                                                    "published action value; empty = no commands")
    mode: str = setting("auto", choices=EXECUTION_MODES, doc="how a new chunk merges with the one executing (auto: "
                                                             "rtc for flow-matching heads with absolute actions, "
                                                             "else replace)")
    control_rate_hz: float = setting(100.0, min=1.0, max=2000.0, doc="rate of joint_command")
    lookahead: float = setting(0.0, min=0.0, doc="seconds added to the measured delay for the hop to the "
                                                  "controller")
    interpolation: str = setting("linear", choices=("linear", "cubic"), doc="between action steps")
    request: str = setting("every_frame", choices=("every_frame", "threshold"),
                            doc="infer on every frame, or only when the queue is below chunk_size_threshold")
    chunk_size_threshold: float = setting(0.5, min=0.0, max=1.0, doc="request: threshold; share of a chunk left")
    temporal_ensemble_coeff: float = setting(0.01, min=0.0, doc="temporal_ensemble: weights exp(-m*i), i=0 the "
                                                                 "oldest prediction")
    delta_mask: tuple[bool, ...] = setting(default_factory=tuple, doc="per joint: true = the action is a delta "
                                                                       "against the joint state of its frame")
    autoenable: bool = setting(False, doc="commands flow from the start (else after ~/enable)")
    chunk_timeout: float = setting(1.0, min=0.0, doc="seconds without a fresh chunk before the watchdog holds "
                                                      "(0 = off)")
    state_timeout: float = setting(0.25, min=0.0, doc="seconds a joint state may age before the watchdog holds "
                                                       "(0 = commands do not need a joint state)")
    on_timeout: str = setting("hold", choices=("hold", "hold_exact", "safe_action"),
                               doc="what the watchdog commands: hold = brake to a stop within the limits; hold_exact "
                                   "= repeat the last command (for controllers that brake themselves); "
                                   "safe_action = go to safe_action within the limits, braking in time")
    safe_action: tuple[float, ...] = setting(default_factory=tuple, doc="on_timeout safe_action: the position per "
                                                                         "joint moved to within the limits")
    limits: LimitsConfig = setting(default_factory=LimitsConfig)
    validate: ChunkValidation = setting(default_factory=ChunkValidation)
    rtc: RTCConfig = setting(default_factory=RTCConfig)

    @property
    def guides_inference(self) -> bool:
        """The plan's model-space leftover steers the next chunk (``rtc``): the plan keeps the model's rows and
        each frame takes the guidance with it."""
        return self.mode in GUIDED_MODES

    def __post_init__(self):
        joints = self.joints
        if len(set(joints)) != len(joints) or not all(j.strip() for j in joints):
            raise ConfigError(f"joints: names must be unique and not empty, got {list(joints)}")
        if self.delta_mask and len(self.delta_mask) != len(joints):
            raise ConfigError(f"delta_mask: {len(self.delta_mask)} values for {len(joints)} joints")
        if self.on_timeout == "safe_action" and len(self.safe_action) != len(joints):
            raise ConfigError(f"safe_action: on_timeout safe_action needs one position per joint ({len(joints)}), "
                              f"got {len(self.safe_action)}")
        if self.guides_inference and any(self.delta_mask):
            raise ConfigError("mode: rtc steers the new chunk towards the last one in the model's action space, "
                              "which delta actions (delta_mask) do not share between frames")
        self.limits.check(joints)
        self.validate.check(joints)
        lo, hi = self.limits.position_min, self.limits.position_max
        for i, v in enumerate(self.safe_action):
            if lo and not lo[i] <= v <= hi[i]:
                raise ConfigError(f"safe_action: joint {joints[i]!r} at {v} lies outside its limits "
                                  f"[{lo[i]}, {hi[i]}]")
