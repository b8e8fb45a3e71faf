"""The node parameters that share one robot computer between the VLA and the VLM (docs/colocation.md).

Both model nodes take ``cpus`` (the cores their threads run on), ``model_scheduling`` (the Linux policy of
every thread of the process, the model's pools among them) and ``accelerator_arbiter`` (a path both nodes
name: the VLA's frames go first, the chat's graph calls wait at their boundaries). vla_node adds
``command_scheduling`` and ``command_cpus`` for the thread that sends ``joint_command``. What could not be
applied (no privilege) is a warning and a diagnostics value, never a failed configure: the node serves as
it would have without the setting.
"""
from __future__ import annotations

import threading

from ..core import sharing
from ..core.config import ModelConfig
from .params import Param, ParameterError

SHARING_PARAMS = [
    Param("cpus", "", "cores this node's threads run on, e.g. '2-5' or '0,2' (empty: every core the process "
                      "may use); sets the model's thread count where its config leaves it to the backend (0)",
          any_type=True),
    Param("model_scheduling", "normal",
          "Linux scheduling of every thread of the node: normal[:nice], batch[:nice], idle (runs only on cores "
          "nothing else wants; for a chat beside a VLA), fifo:N or rr:N (real-time, needs CAP_SYS_NICE or "
          "rtprio)"),
    Param("accelerator_arbiter", "", "a lock path both model nodes name (e.g. /dev/shm/synflux-arbiter): the VLA's "
                                     "frames go first, the VLM's graph calls wait while one is in flight; empty: off"),
]
"""Taken by both model nodes (after COMMON_PARAMS)."""

VLA_SHARING_PARAMS = [
    Param("arbiter_exclusive", True, "with accelerator_arbiter: a frame also waits for the VLM's graph call "
                                     "running when it came (a GPU); false: it only holds the next ones off "
                                     "(a CPU, where an idle-scheduled chat is preempted anyway)"),
    Param("command_scheduling", "normal", "Linux scheduling of the thread that sends joint_command: normal[:nice] "
                                          "or fifo:N / rr:N (real-time, e.g. fifo:80; needs CAP_SYS_NICE or rtprio)"),
    Param("command_cpus", "", "cores of the joint_command thread (empty: the node's cpus)", any_type=True),
]
"""vla_node's: the arbiter's mode and the control loop's thread."""

THREAD_OPTIONS = {"onnxruntime": "intra_op_num_threads", "qnn": "intra_op_num_threads"}
"""Backends whose threads per graph follow ``cpus`` when the config leaves them at 0."""


def parse(node, p: dict, name: str, parser):
    try:
        return parser(p[name])
    except ValueError as exc:
        raise ParameterError(f"[{node.get_name()}] parameter '{name}': {exc}") from None


class MachineShare:
    """What a node applied of the sharing parameters, and what it measures of the contention."""

    def __init__(self, node, p: dict, role: str):
        self.cpus = parse(node, p, "cpus", sharing.parse_cpus)
        self.scheduling = parse(node, p, "model_scheduling", sharing.parse_scheduling)
        self.warnings: list[str] = []
        self.arbiter = None
        if p["accelerator_arbiter"]:
            try:
                self.arbiter = sharing.Arbiter(p["accelerator_arbiter"], role,
                                               exclusive=bool(p.get("arbiter_exclusive", True)))
            except (OSError, ValueError) as exc:
                raise ParameterError(f"[{node.get_name()}] parameter 'accelerator_arbiter': {exc}") from None
        self._times = sharing.ThreadTimes()
        self._last = (0.0, 0.0)
        self.apply(node)

    def apply(self, node) -> None:
        """The core set and policy on every thread now in the process (new ones inherit them)."""
        if self.cpus or not self.scheduling.default:
            problem = sharing.apply_to_threads(None if self.scheduling.default else self.scheduling, self.cpus)
            if problem:
                self.warn(node, f"model_scheduling {self.scheduling} / cpus {sorted(self.cpus)}: {problem}")

    def warn(self, node, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)
            node.get_logger().warning(text)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with the threads per graph of its backend set to the size of ``cpus`` where it says 0."""
        option = THREAD_OPTIONS.get(cfg.executor.backend)
        if not self.cpus or option is None or int(cfg.executor.options.get(option, 0) or 0):
            return cfg
        return cfg.with_overrides(executor={"options": {**cfg.executor.options, option: len(self.cpus)}})

    def close(self) -> None:
        if self.arbiter is not None:
            self.arbiter.close()

    def values(self) -> dict:
        """Diagnostics: the settings, the share of the threads' time spent waiting for a core since the last
        call, and the arbiter's waits."""
        run, wait = self._times.sample()
        d_run, d_wait = run - self._last[0], wait - self._last[1]
        self._last = (run, wait)
        out = {"cpus": ",".join(map(str, sorted(self.cpus))) or "all", "model_scheduling": str(self.scheduling),
               "cpu_wait_ms": wait * 1e3,
               "cpu_wait_share": d_wait / (d_run + d_wait) if d_run + d_wait > 0 else 0.0,
               "sharing_warnings": "; ".join(self.warnings)}
        if self.arbiter is not None:
            out.update(self.arbiter.stats())
            if self.arbiter.role == "control":
                out["arbiter_held_ms"] = self.arbiter.held_s * 1e3
                out["arbiter_max_calls_passed"] = self.arbiter.max_passed
        return out


def apply_to_current_thread(node, share: MachineShare | None, sched: sharing.Scheduling,
                            cpus: frozenset[int]) -> str | None:
    """Give the calling thread ``sched`` and ``cpus`` (the control loop calls this first thing); the reason
    when it could not (also added to ``share``'s warnings)."""
    if sched.default and not cpus:
        return None
    problem = sharing.apply_to_threads(sched, cpus, [threading.get_native_id()])
    if problem:
        text = f"command_scheduling {sched} / command_cpus {sorted(cpus)}: {problem}"
        if share is not None:
            share.warn(node, text)
        else:
            node.get_logger().warning(text)
        return text
    return None
