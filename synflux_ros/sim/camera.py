"""Rendering a MuJoCo camera headless, in a thread of its own (ROS-free).

An OpenGL context is current in the thread that made it, so :class:`Camera` is created, used and closed in
one thread: :class:`FrameRenderer`. The physics thread hands it the configuration to draw
(:meth:`FrameRenderer.request`, newest wins) and carries on stepping; drawing never holds the physics up.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from .robot import SimError


class Camera:
    """A named camera of ``model`` rendering ``width`` x ``height`` RGB frames of a given configuration."""

    def __init__(self, mujoco, model, camera: str, width: int, height: int):
        names = [model.camera(i).name for i in range(model.ncam)]
        if camera not in names:
            raise SimError(f"camera {camera!r} is not in the model (its cameras: {', '.join(names) or 'none'})",
                           "camera")
        if width <= 0 or height <= 0:
            raise SimError(f"image size {width}x{height}: both must be positive", "image_size")
        self.mujoco, self.model, self.camera = mujoco, model, camera
        # The offscreen buffer of the model must hold the frame; a user's model may declare a small one.
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, width)
        model.vis.global_.offheight = max(model.vis.global_.offheight, height)
        self.data = mujoco.MjData(model)
        self.renderer = mujoco.Renderer(model, height, width)
        self.width, self.height = width, height

    def render(self, qpos: np.ndarray) -> np.ndarray:
        """The camera's view of configuration ``qpos``: an HxWx3 uint8 RGB array (a new array)."""
        self.data.qpos[:] = qpos
        self.mujoco.mj_forward(self.model, self.data)
        self.renderer.update_scene(self.data, self.camera)
        return self.renderer.render()

    def close(self) -> None:
        self.renderer.close()


class FrameRenderer:
    """The thread that owns a :class:`Camera`: renders the newest requested configuration and hands each frame
    to ``on_frame(rgb, stamp, render_seconds)``; ``stamp`` is the requester's, passed through."""

    def __init__(self, mujoco, model, camera: str, width: int, height: int, on_frame, name: str = "sim-camera"):
        self._args = (mujoco, model, camera, width, height)
        self._on_frame = on_frame
        self._cond = threading.Condition()
        self._request = None
        self._stop = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.frames = 0
        self.skipped = 0  # requests replaced by a newer one before they were drawn
        self.failures = 0
        self.last_error = ""
        self.render_s = 0.0  # time of the last frame
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, timeout: float = 60.0) -> None:
        """Start the thread and wait until its camera exists; re-raises what creating it raised."""
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise SimError(f"the camera did not start within {timeout:.0f} s", "camera")
        if self._error is not None:
            self._thread.join()
            raise self._error

    def request(self, qpos: np.ndarray, stamp) -> None:
        with self._cond:
            if self._request is not None:
                self.skipped += 1
            self._request = (qpos, stamp)
            self._cond.notify()

    def stop(self, timeout: float = 5.0) -> bool:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            camera = Camera(*self._args)
        except BaseException as exc:  # reported to start(), in the calling thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                with self._cond:
                    while self._request is None and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    qpos, stamp = self._request
                    self._request = None
                t0 = time.perf_counter()
                try:
                    rgb = camera.render(qpos)
                except Exception as exc:  # a failed frame is counted; the next request tries again
                    self.failures += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    continue
                self.render_s = time.perf_counter() - t0
                self.frames += 1
                self._on_frame(rgb, stamp, self.render_s)
        finally:
            camera.close()
