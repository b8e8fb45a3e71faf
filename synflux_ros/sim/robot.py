"""A MuJoCo robot driven by joint position targets (ROS-free): the model, its commanded joints, their servos.

:class:`SimRobot` loads the built-in arm (:mod:`.arm`) or a user's MJCF, finds for each commanded joint the
MuJoCo position actuator (a PD servo computed at every physics step) that drives it, checks commands
(:meth:`SimRobot.check_command`: length, finite values; targets outside a joint's range are clamped to it)
and steps the physics. It is not thread-safe; :class:`.loop.SimLoop` owns it in one thread.
"""
from __future__ import annotations

import math
import os

import numpy as np

from . import arm
from .gl import select_backend

MIN_PHYSICS_RATE_HZ = 200.0


class SimError(ValueError):
    """A model, joint list, rate, initial position or camera that cannot be simulated; the message says which,
    and ``field`` names the setting at fault (model, joint_names, physics_rate, initial_positions, camera,
    image_size)."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


class CommandError(ValueError):
    """A joint command refused (wrong length, NaN or Inf); the message says why."""


def load_mujoco(render: bool):
    """The mujoco module; with ``render``, a headless OpenGL backend is chosen before it is first imported
    (:func:`.gl.select_backend`, which raises :class:`.gl.NoBackend` when none works)."""
    if render:
        select_backend()
    import mujoco
    return mujoco


class SimRobot:
    """One MuJoCo model with ``joint_names`` commanded through position actuators.

    ``model``: an MJCF file ("" = the built-in arm); ``joint_names``: the commanded joints in command order
    (empty = the built-in arm's seven, or, for a user's model, every joint driven by a position actuator in
    actuator order); ``physics_rate_hz``: physics steps per simulated second (the model's timestep is set to
    its inverse; the servos run at this rate); ``initial_positions``: one per joint, also the first target
    (empty = the model's keyframe ``home`` where it has one, else ``qpos0``, within the joint ranges; the rest of
    the scene starts from that keyframe too); ``render``: choose a headless OpenGL backend before mujoco loads
    (the camera needs one).
    """

    def __init__(self, model: str = "", joint_names=(), physics_rate_hz: float = 500.0, initial_positions=(),
                 render: bool = True):
        self.mujoco = mj = load_mujoco(render)
        if not math.isfinite(physics_rate_hz) or physics_rate_hz < MIN_PHYSICS_RATE_HZ:
            raise SimError(f"physics rate {physics_rate_hz!r} Hz: must be at least {MIN_PHYSICS_RATE_HZ:.0f} Hz "
                           "(the servos run at the physics rate)", "physics_rate")
        self.source = os.path.abspath(model) if model else "built-in arm"
        try:
            self.model = mj.MjModel.from_xml_path(model) if model else mj.MjModel.from_xml_string(arm.mjcf())
        except (ValueError, OSError) as exc:  # mujoco raises ValueError for XML and file errors
            raise SimError(f"cannot load MJCF {model!r}: {str(exc).strip()}", "model") from None
        m = self.model
        m.opt.timestep = 1.0 / physics_rate_hz
        self.physics_rate_hz = float(physics_rate_hz)
        names = list(joint_names) or (list(arm.JOINT_NAMES) if not model else self._servoed_joints())
        if not names:
            raise SimError(f"{self.source}: no joint is driven by a position actuator; name the joints to command "
                           "and give each a MuJoCo <position> actuator", "joint_names")
        if len(set(names)) != len(names):
            raise SimError(f"joint names {names}: each joint may appear once", "joint_names")
        self.joint_names = names
        self._qpos, self._qvel, self._ctrl, lo, hi = [], [], [], [], []
        for name in names:
            jid = mj.mj_name2id(m, mj.mjtObj.mjOBJ_JOINT, name)
            if jid < 0:
                known = [m.joint(i).name for i in range(m.njnt)]
                raise SimError(f"joint {name!r} is not in {self.source} (its joints: {', '.join(known)})",
                               "joint_names")
            if int(m.jnt_type[jid]) not in (int(mj.mjtJoint.mjJNT_HINGE), int(mj.mjtJoint.mjJNT_SLIDE)):
                raise SimError(f"joint {name!r}: only hinge and slide joints can be commanded", "joint_names")
            act = self._position_actuator(jid, name)
            self._qpos.append(int(m.jnt_qposadr[jid]))
            self._qvel.append(int(m.jnt_dofadr[jid]))
            self._ctrl.append(act)
            low, high = -np.inf, np.inf
            if m.jnt_limited[jid]:
                low, high = m.jnt_range[jid]
            if m.actuator_ctrllimited[act]:
                low, high = max(low, m.actuator_ctrlrange[act][0]), min(high, m.actuator_ctrlrange[act][1])
            lo.append(low)
            hi.append(high)
        self.lower, self.upper = np.array(lo), np.array(hi)
        self.data = mj.MjData(m)
        self._home = mj.mj_name2id(m, mj.mjtObj.mjOBJ_KEY, "home")
        if self._home >= 0:
            mj.mj_resetDataKeyframe(m, self.data, self._home)
        start = self._initial(initial_positions)
        self.data.qpos[self._qpos] = start
        mj.mj_forward(m, self.data)
        self.target = start.copy()
        self.data.ctrl[self._ctrl] = self.target

    # ------------------------------------------------------------------ model inspection
    def _position_actuator(self, jid: int, name: str) -> int:
        mj, m = self.mujoco, self.model
        for a in range(m.nu):
            if int(m.actuator_trntype[a]) == int(mj.mjtTrn.mjTRN_JOINT) and m.actuator_trnid[a][0] == jid:
                if not self._is_position_servo(a):
                    raise SimError(f"joint {name!r}: its actuator {m.actuator(a).name or a!r} is not a position "
                                   "servo (a MuJoCo <position> actuator with kp, or gain kp and bias [0, -kp, -kv])",
                                   "joint_names")
                return a
        raise SimError(f"joint {name!r} has no actuator in {self.source}: add a MuJoCo <position> actuator "
                       f"(kp, kv) on it", "joint_names")

    def _is_position_servo(self, a: int) -> bool:
        mj, m = self.mujoco, self.model
        kp = m.actuator_gainprm[a][0]
        return (int(m.actuator_gaintype[a]) == int(mj.mjtGain.mjGAIN_FIXED)
                and int(m.actuator_biastype[a]) == int(mj.mjtBias.mjBIAS_AFFINE)
                and int(m.actuator_dyntype[a]) == int(mj.mjtDyn.mjDYN_NONE)
                and kp > 0 and math.isclose(m.actuator_biasprm[a][1], -kp))

    def _servoed_joints(self) -> list[str]:
        mj, m = self.mujoco, self.model
        return [m.joint(int(m.actuator_trnid[a][0])).name for a in range(m.nu)
                if int(m.actuator_trntype[a]) == int(mj.mjtTrn.mjTRN_JOINT) and self._is_position_servo(a)]

    def _initial(self, values) -> np.ndarray:
        if len(values) == 0:
            m = self.model
            start = m.key_qpos[self._home] if self._home >= 0 else m.qpos0
            return np.clip(start[self._qpos], self.lower, self.upper)
        v = np.asarray(values, dtype=float)
        if v.shape != (len(self.joint_names),):
            raise SimError(f"initial positions: {len(v)} values for {len(self.joint_names)} joints "
                           f"{self.joint_names}", "initial_positions")
        outside = [f"{n}={x:g} (range {lo:g} .. {hi:g})" for n, x, lo, hi in
                   zip(self.joint_names, v, self.lower, self.upper) if not lo <= x <= hi]
        if outside:
            raise SimError(f"initial positions outside the joint ranges: {', '.join(outside)}", "initial_positions")
        return v

    def camera_names(self) -> list[str]:
        return [self.model.camera(i).name for i in range(self.model.ncam)]

    @property
    def timestep(self) -> float:
        return float(self.model.opt.timestep)

    # ------------------------------------------------------------------ commands and stepping
    def check_command(self, values) -> tuple[np.ndarray, int]:
        """The target a command asks for, clamped to the joint ranges, and how many values were clamped.
        Raises :class:`CommandError` for a wrong length or a value that is not finite."""
        v = np.asarray(values, dtype=float)
        if v.shape != (len(self.joint_names),):
            raise CommandError(f"{v.size} values for {len(self.joint_names)} joints ({', '.join(self.joint_names)})")
        bad = [f"{n}={x}" for n, x in zip(self.joint_names, v) if not math.isfinite(x)]
        if bad:
            raise CommandError(f"not finite: {', '.join(bad)}")
        clamped = np.clip(v, self.lower, self.upper)
        return clamped, int(np.count_nonzero(clamped != v))

    def set_target(self, target: np.ndarray) -> None:
        """A target from :meth:`check_command`; the servos follow it from the next step."""
        self.target = np.array(target, dtype=float)
        self.data.ctrl[self._ctrl] = self.target

    def step(self, n: int = 1) -> None:
        self.mujoco.mj_step(self.model, self.data, nstep=n)

    @property
    def time(self) -> float:
        return float(self.data.time)

    def positions(self) -> np.ndarray:
        return self.data.qpos[self._qpos].copy()

    def velocities(self) -> np.ndarray:
        return self.data.qvel[self._qvel].copy()

    def efforts(self) -> np.ndarray:
        """The force or torque each servo applies (after its force limit)."""
        return self.data.actuator_force[self._ctrl].copy()

    def qpos(self) -> np.ndarray:
        """The whole configuration (every joint, free bodies too), what a camera needs to draw the scene."""
        return self.data.qpos.copy()
