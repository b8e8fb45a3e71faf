"""Headless OpenGL for MuJoCo's camera: which backend works on this machine, chosen before mujoco loads.

MuJoCo takes its OpenGL backend from ``MUJOCO_GL`` when it is imported, and PyOpenGL fixes its platform
once per process, so a backend that fails cannot be swapped for another in the same process. Each
candidate (EGL, then OSMesa) is therefore tried in a short child process first (:func:`select_backend`).
Run as a script it prints the backend that works here, or says what to install and exits with 1; the
Makefile's ``sim-venv`` target runs it that way. Standard library only, so that it runs from the source tree.
"""
from __future__ import annotations

import os
import subprocess
import sys

BACKENDS = ("egl", "osmesa")
"""Headless backends in the order they are tried: EGL (a GPU driver's, or Mesa's surfaceless llvmpipe), then
OSMesa (Mesa's software renderer, Debian package libosmesa6)."""

INSTALL_HINT = (
    "no headless OpenGL backend for MuJoCo's camera works here. EGL needs a GPU driver's libEGL or Mesa's "
    "(Debian/Ubuntu: apt-get install libegl1 libegl-mesa0 libgl1-mesa-dri); OSMesa needs Mesa's software "
    "renderer (apt-get install libosmesa6). Or set MUJOCO_GL to a backend that works here (egl, osmesa; glfw "
    "with a display), or set the node's camera_rate_hz to 0 to run without a camera")

PROBE_TIMEOUT_S = 60.0

_PROBE = """
import mujoco
m = mujoco.MjModel.from_xml_string('<mujoco><worldbody><light pos="0 0 1"/><geom size=".1"/></worldbody></mujoco>')
d = mujoco.MjData(m)
mujoco.mj_forward(m, d)
r = mujoco.Renderer(m, 16, 16)
r.update_scene(d)
assert r.render().shape == (16, 16, 3)
r.close()
print("rendered")
"""

_chosen: str | None = None


class NoBackend(RuntimeError):
    """No headless OpenGL backend works; the message says what to install."""


def probe(backend: str, python: str = sys.executable, timeout: float = PROBE_TIMEOUT_S) -> str:
    """Render one small frame with ``MUJOCO_GL=backend`` in a child process; "" when it worked, else the
    last lines of its error output."""
    env = dict(os.environ, MUJOCO_GL=backend, PYOPENGL_PLATFORM=backend)
    try:
        r = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"no frame within {timeout:.0f} s"
    if r.returncode == 0 and "rendered" in r.stdout:
        return ""
    lines = [line for line in (r.stderr or r.stdout).strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {r.returncode}"


def select_backend(candidates=BACKENDS) -> str:
    """The OpenGL backend MuJoCo renders with in this process, set in ``MUJOCO_GL`` before mujoco is imported.

    A ``MUJOCO_GL`` already set is the user's choice and is kept as it is. Otherwise the ``candidates`` are
    probed in order and the first that renders is taken. Raises :class:`NoBackend` (naming what each
    backend said and what to install) when none does, or when mujoco was imported before a backend was
    chosen (it then uses a windowed backend that cannot render headless).
    """
    global _chosen
    if _chosen:
        return _chosen
    given = os.environ.get("MUJOCO_GL", "").strip().lower()
    if given:
        if given in BACKENDS:  # PyOpenGL's platform must be the same one (a stale other value only fails)
            os.environ["PYOPENGL_PLATFORM"] = given
        _chosen = given
        return given
    if "mujoco" in sys.modules:
        raise NoBackend("mujoco was imported before a headless OpenGL backend was chosen: set MUJOCO_GL (egl or "
                        "osmesa) in the environment, or call synflux_ros.sim.gl.select_backend() before "
                        "importing mujoco")
    failures = []
    for backend in candidates:
        error = probe(backend)
        if not error:
            os.environ["MUJOCO_GL"] = backend
            os.environ["PYOPENGL_PLATFORM"] = backend
            _chosen = backend
            return backend
        failures.append(f"{backend}: {error}")
    raise NoBackend(f"{INSTALL_HINT} (tried {'; '.join(failures)})")


def main(argv=None) -> int:
    try:
        print(select_backend())
    except NoBackend as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
