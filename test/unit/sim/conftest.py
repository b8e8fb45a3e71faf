"""The sim room's tests render in this process: a headless OpenGL backend is chosen before mujoco is imported."""
import pytest

from synflux_ros.sim import gl

try:
    gl.select_backend()
except gl.NoBackend as exc:  # the physics tests still run; the camera tests skip with this reason
    NO_GL = str(exc)
else:
    NO_GL = ""

pytest.importorskip("mujoco", reason="mujoco is not installed (make sim-venv)")


@pytest.fixture()
def needs_gl():
    if NO_GL:
        pytest.skip(NO_GL)
