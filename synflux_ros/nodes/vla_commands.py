"""The half of the VLA node that commands the arm: chunks handed to the controller, ``joint_command`` each
control tick, ``joint_trajectory`` on each chunk, the ``~/enable`` service and the controller's diagnostics.

:class:`ChunkCommands` is a part of :class:`~synflux_ros.nodes.vla_node.VLANode` kept apart: it uses the node's
``cfg``, ``joint_names``, ``_pubs``, ``_active`` and ``_now()``; the node calls :meth:`_setup_execution` at
configure, the ``_start``/``_stop``/``_destroy_commands`` hooks with its lifecycle, :meth:`_execute` on each
chunk and :meth:`_execution_diagnostics` with its ``/diagnostics``. The chunks run on the robot's clock in the
ROS-free ``execution`` room (docs/execution.md).
"""
from __future__ import annotations

import sys

import numpy as np
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from std_msgs.msg import Float64MultiArray
from std_srvs.srv import SetBool
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from ..core.sharing import parse_cpus, parse_scheduling
from ..execution.controller import ControlLoop, Controller
from ..execution.plan import CLOCK_SKEW_S, SIM_CLOCK_SKEW_S, ChunkRefused
from ..runtimes.vla import Frame
from .sharing import apply_to_current_thread, parse
from .stamps import stamp_seconds, to_duration, to_stamp


COMMAND_SWITCH_INTERVAL_S = 0.0005
"""The interpreter's switch interval with a real-time command thread (docs/colocation.md)."""


class ChunkCommands:
    """Commands from chunks, for a node with execution joints; see the module docstring."""

    controller: Controller | None = None
    _control_loop: ControlLoop | None = None
    _enable_srv = None
    _chunk_error = ""

    def _setup_execution(self, p: dict, cfg) -> None:
        """The chunk executor, its command streams, the enable service and the control timer."""
        ex = cfg.resolved_execution
        sim_time = bool(self.get_parameter("use_sim_time").value)  # stamps may lead the clock by a /clock's lag
        self.controller = Controller(ex, cfg.action.step_period, cfg.action.published_horizon,
                                     SIM_CLOCK_SKEW_S if sim_time else CLOCK_SKEW_S)
        if p["publish_joint_command"]:
            self._pubs["command"] = self.create_lifecycle_publisher(Float64MultiArray, "joint_command", 10)
        if p["publish_joint_trajectory"]:
            self._pubs["traj"] = self.create_lifecycle_publisher(JointTrajectory, "joint_trajectory", 10)
        # The control ticks run in a thread of their own (not an executor timer): the executor's other callbacks
        # (image decoding, the pipeline's results) would delay and bunch them. The controller takes a lock.
        self._enable_srv = self.create_service(SetBool, "~/enable", self._on_enable,
                                               callback_group=MutuallyExclusiveCallbackGroup())
        sched = parse(self, p, "command_scheduling", parse_scheduling)
        cpus = parse(self, p, "command_cpus", parse_cpus)
        if sched.policy in ("idle", "batch"):
            raise self.fail("command_scheduling", f"{sched}: the command thread needs normal or a real-time policy")
        if sched.policy in ("fifo", "rr"):
            # A real-time thread has its core at once but still waits for the interpreter lock, which a busy
            # thread hands over only after the switch interval (5 ms by default): shortened, the wait is too.
            sys.setswitchinterval(min(sys.getswitchinterval(), COMMAND_SWITCH_INTERVAL_S))
        self._control_loop = ControlLoop(self.controller, self._now, self._send_command, self._on_tick_error,
                                         on_start=lambda: apply_to_current_thread(self, self.share, sched, cpus))

    def _start_commands(self) -> None:
        """At activation: the control loop runs, and with ``execution.autoenable`` the commands are enabled."""
        if self._control_loop is not None:
            self._control_loop.start()
        if self.controller is not None and self.cfg.execution.autoenable:
            try:
                self.get_logger().info(f"commands {self.controller.enable(self._now())} (execution.autoenable)")
            except ValueError as exc:
                self.get_logger().error(f"execution.autoenable: {exc}; call ~/enable once the state arrives")

    def _stop_commands(self) -> None:
        """At deactivation: commands disabled, the control loop stopped (started again at activation)."""
        if self.controller is not None:
            self.controller.disable("deactivated")
            self._control_loop.stop()

    def _destroy_commands(self) -> None:
        """At cleanup: commands disabled, the control loop and the enable service gone."""
        if self.controller is not None:
            self.controller.disable("cleaned up")
        if self._control_loop is not None:
            self._control_loop.stop()
            self._control_loop = None
        if self._enable_srv is not None:
            self.destroy_service(self._enable_srv)
            self._enable_srv = None

    def halt_commands(self) -> None:
        """At a signal: the control loop sends nothing more (a flag its thread reads before each send; the
        controller's lock is not taken here, in the signal handler). Teardown disables and joins it later."""
        loop = self._control_loop
        if loop is not None:
            loop.halted = True

    def _execute(self, frame: Frame):
        """Hand a chunk to the controller; a refused one is counted and logged, the plan in force goes on."""
        now = self._now()
        t_obs = stamp_seconds(frame.meta.stamp)
        try:
            self.controller.on_chunk(frame.actions, t_obs, now, frame.raw_actions)
        except ChunkRefused as exc:
            self._chunk_error = f"chunk of frame {frame.seq} refused: {exc}"
            self.get_logger().warning(self._chunk_error, throttle_duration_sec=2.0)
            return
        if "traj" in self._pubs:
            points = self.controller.trajectory(now)
            if points:
                traj = self._trajectory(points, now)
                traj.header.frame_id = frame.meta.frame_id
                self._pubs["traj"].publish(traj)

    def _trajectory(self, points, now: float) -> JointTrajectory:
        """Stamped now; every point lies ahead of it (header.stamp + time_from_start > now)."""
        traj = JointTrajectory()
        traj.header.stamp = to_stamp(now)
        traj.joint_names = list(self.joint_names)
        for t, row in points:
            traj.points.append(JointTrajectoryPoint(positions=[float(v) for v in row], time_from_start=to_duration(t)))
        return traj

    def _send_command(self, cmd):
        pub = self._pubs.get("command")
        if pub is not None and self._active:
            pub.publish(Float64MultiArray(data=[float(v) for v in cmd]))

    def _on_tick_error(self, exc: Exception):
        self.get_logger().error(f"control tick failed: {type(exc).__name__}: {exc}", throttle_duration_sec=2.0)

    def _on_enable(self, request, response):
        if request.data:
            if not self._active:
                response.success, response.message = False, "cannot enable: the node is not active"
            else:
                try:
                    response.success, response.message = True, self.controller.enable(self._now())
                except ValueError as exc:
                    response.success, response.message = False, str(exc)
        else:
            self.controller.disable("disabled by ~/enable")
            response.success, response.message = True, "disabled"
        self.get_logger().info(f"~/enable {request.data}: {response.message}")
        return response

    def _execution_diagnostics(self, values: dict, counts: dict) -> list[str]:
        """The controller's state and every intervention, counted; the problems worth a WARN."""
        c = self.controller
        status = c.status
        offer = c.last_offer
        values.update(execution_mode=c.cfg.mode, commands_enabled=c.enabled,
                      command_state=status.state, command_reason=status.reason, frames_not_needed=counts["not_needed"],
                      chunk_delay_steps=offer.delay_steps if offer else -1,
                      chunk_delay_ms=offer.delay_s * 1e3 if offer else float("nan"),
                      last_switch_jump=offer.switch_jump if offer else float("nan"),
                      last_switch_disagreement=offer.disagreement if offer else float("nan"),
                      last_chunk_error=self._chunk_error, hold_reaction_ms=c.hold_reaction_s * 1e3)
        for key in ("chunks_accepted", "chunks_refused", "chunks_late", "chunks_non_finite", "chunks_unplaced",
                    "ticks_commanded", "ticks_held", "watchdog_holds", "hold_stale_state", "hold_chunk_timeout",
                    "hold_ran_out", "hold_no_chunk", "position_limit", "velocity_limit", "acceleration_limit",
                    "braking", "max_relative_target", "jerk_limit", "relative_target_unmet", "braking_unmet",
                    "jerk_unmet",
                    "enable_while_enabled", "enabled_outside_limits", "states_from_the_future", "chunks_invalid",
                    "chunks_clipped"):
            values[key] = c.counts[key]
        loop = self._control_loop
        if loop is not None:
            late = loop.lateness()
            values.update(control_ticks=loop.ticks, control_ticks_late=loop.late_ticks,
                          control_ticks_skipped=loop.skipped_ticks, control_max_late_ms=loop.max_late_s * 1e3,
                          control_late_p99_ms=float(np.percentile(late, 99)) * 1e3 if late.size else 0.0,
                          control_recent_max_late_ms=float(late.max()) * 1e3 if late.size else 0.0)
        problems = []
        if status.state == "holding":
            problems.append(f"holding: {status.reason}")
        if c.counts["chunks_refused"]:
            problems.append(f"{c.counts['chunks_refused']} chunks refused")
        return problems
