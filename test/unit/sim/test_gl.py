"""Choosing MuJoCo's headless OpenGL backend: a MUJOCO_GL given is kept, a backend that fails is named with what
to install, and the script the Makefile runs prints the backend that works."""
import os
import subprocess
import sys

import pytest

from synflux_ros.sim import gl


@pytest.fixture()
def fresh(monkeypatch):
    monkeypatch.setattr(gl, "_chosen", None)
    monkeypatch.delenv("PYOPENGL_PLATFORM", raising=False)  # restored afterwards, whatever the test set
    return monkeypatch


def test_a_backend_set_by_the_user_is_kept(fresh):
    fresh.setenv("MUJOCO_GL", "OSMesa")
    assert gl.select_backend() == "osmesa"


def test_no_working_backend_says_what_to_install(fresh):
    fresh.delenv("MUJOCO_GL", raising=False)
    fresh.delitem(sys.modules, "mujoco")  # as in a process that has not loaded it yet
    with pytest.raises(gl.NoBackend) as err:
        gl.select_backend(candidates=("nosuch",))
    text = str(err.value)
    assert "apt-get install libosmesa6" in text and "libegl-mesa0" in text and "camera_rate_hz" in text
    assert "tried nosuch: " in text and "MUJOCO_GL" in text
    assert "MUJOCO_GL" not in os.environ  # nothing chosen


def test_mujoco_loaded_before_a_choice_is_an_error(fresh):
    fresh.delenv("MUJOCO_GL", raising=False)
    import mujoco  # noqa: F401  (loaded by this test session already)
    with pytest.raises(gl.NoBackend, match="mujoco was imported before a headless OpenGL backend was chosen"):
        gl.select_backend()


def test_the_script_prints_the_backend_that_renders_here():
    env = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "PYOPENGL_PLATFORM")}
    r = subprocess.run([sys.executable, gl.__file__], env=env, capture_output=True, text=True, timeout=120)
    if r.returncode:
        assert "no headless OpenGL backend" in r.stderr
        pytest.skip(r.stderr.strip())
    assert r.stdout.strip() in gl.BACKENDS
    assert gl.probe(r.stdout.strip()) == ""


def test_a_given_backend_sets_pyopengl_to_the_same_platform(fresh):
    fresh.setenv("MUJOCO_GL", "osmesa")
    fresh.setenv("PYOPENGL_PLATFORM", "egl")  # e.g. left over from another process's choice
    assert gl.select_backend() == "osmesa"
    assert os.environ["PYOPENGL_PLATFORM"] == "osmesa"
