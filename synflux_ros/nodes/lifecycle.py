"""The lifecycle both model nodes share (:class:`SynfluxNode`).

A subclass sets ``MODE`` and ``PARAMS`` and implements the hooks; the base reads and checks the parameters,
loads the model config, publishes ``/diagnostics`` while configured and frees the runtime's device memory on
cleanup and shutdown. A failed configure is reported and leaves the node ready for the next attempt.
"""
from __future__ import annotations

import gc

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import State, TransitionCallbackReturn

from ..core.config import ConfigError, ModelConfig
from ..runtimes import open_runtime
from .diagnostics import ERROR, diagnostic_array
from .params import Param, ParameterError, declare, load_node_config, read
from .sharing import MachineShare


def destroy_entities(node, subscriptions: list, publishers: dict) -> None:
    """Destroy the subscriptions and publishers a node keeps in ``subscriptions`` and ``publishers`` (both are
    emptied): what a node's cleanup shares whatever else it frees."""
    for s in subscriptions:
        node.destroy_subscription(s)
    subscriptions.clear()
    for pub in publishers.values():
        node.destroy_publisher(pub)
    publishers.clear()


class ManagedNode(LifecycleNode):
    """The transitions every node of the package shares: deactivate stops the work (:meth:`stop_work`),
    cleanup and shutdown free all that configure made (:meth:`release_resources`); ``/diagnostics`` comes
    from ``_diag`` on the timer ``_timer``, which :meth:`destroy_diagnostics` removes."""

    def __init__(self, node_name: str, **kwargs):
        super().__init__(node_name, **kwargs)
        self._active = False
        self._timer = None
        self._diag = None

    def stop_work(self) -> None:
        pass

    def halt_commands(self) -> None:
        """Stop commanding the robot at once: called from the SIGINT/SIGTERM handler, before the ordered
        shutdown. Must not block or take locks; nodes that command nothing have nothing to do."""

    def release_resources(self) -> None:
        raise NotImplementedError

    def try_configure(self, configure) -> bool:
        """Run ``configure()``; on a ParameterError or any other exception say why once (``last_error``), free
        what was made and return False: the node stays unconfigured, ready for another attempt."""
        self.last_error = ""
        try:
            configure()
        except ParameterError as exc:
            self.last_error = str(exc)
        except Exception as exc:  # anything else while loading: report it, do not crash the process
            self.last_error = f"[{self.get_name()}] configure failed: {type(exc).__name__}: {exc}"
        if self.last_error:
            self.get_logger().error(self.last_error)
            self.release_resources()
            return False
        return True

    def destroy_diagnostics(self) -> None:
        if self._timer is not None:
            self.destroy_timer(self._timer)
            self._timer = None
        if self._diag is not None:
            self.destroy_publisher(self._diag)
            self._diag = None

    def on_deactivate(self, state: State) -> TransitionCallbackReturn:
        self._active = False
        self.stop_work()
        return super().on_deactivate(state)

    def on_cleanup(self, state: State) -> TransitionCallbackReturn:
        self.release_resources()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        self.release_resources()
        return TransitionCallbackReturn.SUCCESS


class SynfluxNode(ManagedNode):
    """Lifecycle shared by the model nodes.

    configure: read and validate parameters, load the model config, ``setup()`` (runtime, ROS
    entities), start diagnostics; activate/deactivate: ``activate()``/``deactivate()``;
    cleanup/shutdown: ``teardown()`` then free the runtime's device memory. Subclasses set ``MODE``
    ('vla' or 'vlm') and ``PARAMS`` and implement the hooks.
    """

    MODE = ""
    ROLE = "background"  # on the accelerator arbiter: "control" (the VLA) or "background" (the chat)
    PARAMS: list[Param] = []
    share: MachineShare | None = None

    def __init__(self, node_name: str, **kwargs):
        super().__init__(node_name, **kwargs)
        declare(self, self.PARAMS)
        self.last_error = ""
        self.runtime = None

    # hooks -------------------------------------------------------------
    def setup(self, params: dict, cfg: ModelConfig) -> str:
        """Create the runtime and ROS entities; return a one-line summary. Raise ParameterError."""
        raise NotImplementedError

    def activate(self) -> None:
        pass

    def deactivate(self) -> None:
        pass

    def teardown(self) -> None:
        pass

    def diagnostics(self) -> tuple[int, str, dict]:
        """(level, message, values) for /diagnostics."""
        raise NotImplementedError

    # helpers -------------------------------------------------------------
    def fail(self, param: str, problem: str) -> ParameterError:
        return ParameterError(f"[{self.get_name()}] parameter '{param}': {problem}")

    def load_runtime(self, cfg: ModelConfig):
        """The runtime of ``cfg``, local or remote (:func:`~synflux_ros.runtimes.open_runtime`); a model that
        cannot be loaded is a ParameterError naming it and the executor."""
        try:
            return open_runtime(cfg)
        except (ConfigError, ImportError, ValueError) as exc:
            raise ParameterError(f"[{self.get_name()}] cannot load model {cfg.name!r} with executor "
                                 f"{cfg.executor.backend!r}: {exc}") from None

    # lifecycle -----------------------------------------------------------
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        def configure():  # all of it: whatever raises is reported once and undone (try_configure)
            p = read(self, self.PARAMS)
            if p["diagnostics_period"] <= 0:
                raise self.fail("diagnostics_period", f"must be > 0, got {p['diagnostics_period']!r}")
            cfg = load_node_config(self, self.MODE, p["config"], p["executor"], p["graph_dir"])
            self.share = MachineShare(self, p, self.ROLE)  # before the model's threads exist: they inherit it
            cfg = self.share.config(cfg)
            self.get_logger().info(f"loading {cfg.name!r} on {cfg.executor.backend!r}")
            summary = self.setup(p, cfg)
            self.cfg = cfg
            self._diag = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
            # on the steady clock: diagnostics go on when simulated time (use_sim_time) stands still
            self._timer = self.create_timer(p["diagnostics_period"], self._publish_diagnostics,
                                            callback_group=MutuallyExclusiveCallbackGroup(),
                                            clock=Clock(clock_type=ClockType.STEADY_TIME))
            self.get_logger().info(f"configured {summary}, "
                                   f"{self.runtime.executor.device_bytes / 2**20:.1f} MiB device memory")
        if not self.try_configure(configure):  # a failed configure does not poison the next attempt
            return TransitionCallbackReturn.FAILURE
        # What start-up made (modules, the model, the ROS entities: some 40,000 objects) is kept out of the cyclic
        # collector's full passes, which otherwise scan it all (7-10 ms) holding the interpreter lock that the
        # command thread and the pipeline wait for. Given back at cleanup.
        gc.freeze()
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        self.activate()
        self._active = True
        return super().on_activate(state)

    def stop_work(self) -> None:
        self.deactivate()

    def release_resources(self) -> None:
        self._active = False
        gc.unfreeze()  # what configure froze is collectable again once freed
        self.teardown()
        self.destroy_diagnostics()
        if self.runtime is not None:
            if self.runtime_in_use():
                self.get_logger().error("the model is still in use by a device call; its memory is freed at "
                                        "process exit instead")
            else:
                self.runtime.close()
            self.runtime = None
        if self.share is not None:
            self.share.close()
            self.share = None

    def runtime_in_use(self) -> bool:
        """A thread is still inside the runtime (e.g. a device call that outlived a stop)."""
        return False

    def _publish_diagnostics(self):
        if self.runtime is None:
            return
        level, message, values = self.diagnostics()
        if not self._active:
            level, message = ERROR, "inactive"
        self._diag.publish(diagnostic_array(self, f"{self.get_fully_qualified_name()}: {self.MODE}",
                                            f"synflux/{self.cfg.executor.backend}", level, message, values))
