"""vla_node with a model that takes several cameras per frame (vision.cameras), over real DDS: one image topic per
camera; the first camera's frames take the other cameras' images nearest in stamp; a frame for which another
camera has no image within vision.camera_max_skew is counted and skipped with the reason."""
from __future__ import annotations

import time

import numpy as np
import pytest
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image

from synflux_ros.tools.harness import chunk_for_frame, rgb_image, spin_until

from ros_clients import Harness

SECOND = 10**9
MS = 10**6


@pytest.fixture()
def cameras(start_node, client, make_config):
    cfg = make_config("vla_demo_orin.yaml", vision={"cameras": ["front", "wrist"], "camera_max_skew": 0.05})
    start_node("vla_node", {"config": cfg, "executor": "mock", "diagnostics_period": 0.2}, namespace="/cams")
    h = Harness(client, "/cams", camera="front")
    h.wrist_pub = client.create_publisher(Image, "/cams/wrist/image", qos_profile_sensor_data)
    h.wait_connected()
    assert spin_until(client, lambda: h.wrist_pub.get_subscription_count() > 0, 20.0), \
        "vla_node never subscribed to wrist/image"
    return h


def chunk_for(h: Harness, stamp: int, wrist_seed: int, timeout: float = 20.0) -> np.ndarray:
    """A wrist image 10 ms before a front frame stamped ``stamp`` (again with later stamps while best-effort
    messages are lost) until that frame's chunk arrives; returns its actions."""
    def publish(t):
        h.wrist_pub.publish(rgb_image(240, 320, wrist_seed, t - 10 * MS))
        time.sleep(0.02)
        h.image_pub.publish(rgb_image(448, 448, 0, t))
    c = chunk_for_frame(h.node, h.chunks, publish, stamp, timeout)
    return np.array(c.actions).reshape(c.horizon, c.action_dim)


def test_a_frame_without_every_cameras_image_is_counted_and_skipped(cameras):
    h = cameras
    frame = rgb_image(448, 448, 0, 50 * SECOND)
    d = h.publish_until_diag(frame, lambda d: int(d.get("frames_no_camera", 0)) >= 2)
    assert "no 'wrist' image received yet on 'wrist/image'" in d["last_error"] and not h.chunks
    h.wrist_pub.publish(rgb_image(240, 320, 1, 50 * SECOND - 200 * MS))
    d = h.publish_until_diag(frame, lambda d: "'wrist' image is 200 ms older than the frame" in d["last_error"])
    assert "(vision.camera_max_skew: 50 ms)" in d["last_error"] and int(d["camera_images_received"]) >= 1
    chunk_for(h, 60 * SECOND, 1)
    d = h.diag_where(lambda d: int(d["frames_published"]) >= 1 and d["frames_in_flight"] == "0")
    assert int(d["frames_received"]) == sum(int(d[k]) for k in (
        "frames_published", "frames_dropped", "frames_rejected", "frames_failed", "frames_no_state",
        "frames_no_camera", "frames_while_inactive"))


def test_the_second_cameras_image_reaches_the_model(cameras):
    h = cameras
    a = chunk_for(h, 70 * SECOND, 1)
    again = chunk_for(h, 71 * SECOND, 1)
    other = chunk_for(h, 72 * SECOND, 2)
    np.testing.assert_allclose(a, again, rtol=0, atol=1e-6)  # same front frame, same wrist image
    assert np.abs(a - other).max() > 1e-4  # only the wrist image differs
