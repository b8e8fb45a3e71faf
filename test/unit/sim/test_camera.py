"""The headless camera: frames of the asked size that show the scene, change when the arm moves, differ between
cameras; the rendering thread hands frames back with their stamps and reports a bad camera at start."""
import threading

import numpy as np
import pytest

from synflux_ros.sim.camera import Camera, FrameRenderer
from synflux_ros.sim.robot import SimError, SimRobot

pytestmark = pytest.mark.usefixtures("needs_gl")


@pytest.fixture(scope="module")
def robot():
    return SimRobot()


def test_frames_show_the_scene_and_follow_the_arm(robot):
    cam = Camera(robot.mujoco, robot.model, "scene", 160, 120)
    try:
        home = cam.render(robot.qpos())
        assert home.shape == (120, 160, 3) and home.dtype == np.uint8
        assert home.std() > 20 and len(np.unique(home.reshape(-1, 3), axis=0)) > 50
        moved = robot.qpos()
        moved[robot._qpos[0]] = 1.2  # the base turned
        other = cam.render(moved)
        assert np.abs(other.astype(int) - home).mean() > 1.0
        np.testing.assert_array_equal(cam.render(robot.qpos()), home)  # the same pose draws the same picture
    finally:
        cam.close()
    wrist = Camera(robot.mujoco, robot.model, "wrist", 160, 120)
    try:
        assert np.abs(wrist.render(robot.qpos()).astype(int) - home).mean() > 10
    finally:
        wrist.close()


def test_a_frame_larger_than_the_models_offscreen_buffer(robot):
    cam = Camera(robot.mujoco, robot.model, "scene", 1600, 64)
    try:
        assert cam.render(robot.qpos()).shape == (64, 1600, 3)
    finally:
        cam.close()


def test_an_unknown_camera_lists_the_models_cameras(robot):
    with pytest.raises(SimError, match=r"camera 'top' is not in the model \(its cameras: scene, wrist\)") as err:
        Camera(robot.mujoco, robot.model, "top", 64, 64)
    assert err.value.field == "camera"


def test_the_rendering_thread_returns_frames_with_their_stamps(robot):
    got, done = [], threading.Event()

    def on_frame(rgb, stamp, seconds):
        got.append((rgb.shape, stamp, threading.current_thread().name, seconds))
        if len(got) == 3:
            done.set()
    frames = FrameRenderer(robot.mujoco, robot.model, "wrist", 96, 64, on_frame)
    frames.start()
    try:
        for stamp in ("a", "b", "c"):
            frames.request(robot.qpos(), stamp)
            while frames.frames + frames.skipped < "abc".index(stamp) + 1:
                threading.Event().wait(0.005)
        assert done.wait(10) or frames.skipped
    finally:
        assert frames.stop()
    assert frames.frames + frames.skipped == 3 and frames.failures == 0
    assert all(shape == (64, 96, 3) and name == "sim-camera" and s > 0 for shape, _, name, s in got)
    assert [stamp for _, stamp, _, _ in got] == sorted(stamp for _, stamp, _, _ in got)


def test_a_bad_camera_fails_the_start_of_the_rendering_thread(robot):
    frames = FrameRenderer(robot.mujoco, robot.model, "nope", 64, 64, lambda *a: None)
    with pytest.raises(SimError, match="camera 'nope' is not in the model"):
        frames.start()
    assert frames.stop()
