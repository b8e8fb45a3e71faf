"""The bicubic preprocessing with a centre crop equals LeRobot 0.6.1's GR00T N1.7 image geometry and Qwen image
processor (``test/reference/groot_image_reference.py``, run in ``.venv-lerobot06``): the float32 pixels the vision
tower gets agree to 1e-5 for camera frames of 256x256, 224x224, 480x640 and 240x320, noise (where the fixed
point's clipping after each axis shows) and smooth content."""
from __future__ import annotations

import numpy as np
import pytest

from synflux_ros.core.config import PreprocessSpec
from synflux_ros.model.image import Preprocessor

from pi0_reference import LEROBOT_VENVS, ROOT, reference

SCRIPT = ROOT / "test" / "reference" / "groot_image_reference.py"
SIZES = [(256, 256), (224, 224), (480, 640), (240, 320)]
TOLERANCE = 1e-5

pytestmark = [pytest.mark.reference,
              pytest.mark.skipif(not LEROBOT_VENVS["lerobot061"][0].exists(),
                                 reason=f"the lerobot061 reference venv is missing ({LEROBOT_VENVS['lerobot061'][1]})")]


def frames() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(37)
    out = {}
    for h, w in SIZES:
        out[f"noise_{h}x{w}"] = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        yy, xx = np.mgrid[0:h, 0:w]
        smooth = np.stack([127 + 120 * np.sin(xx / 17.0), 127 + 120 * np.cos(yy / 11.0), (xx + 2 * yy) % 256], -1)
        out[f"smooth_{h}x{w}"] = np.rint(smooth).astype(np.uint8)
    return out


@pytest.mark.parametrize("crop_fraction,edge", [(None, None), (0.75, 200)], ids=["n17-default", "crop-edge"])
def test_pixels_equal_lerobot(tmp_path, crop_fraction, edge):
    inputs = frames()
    np.savez(tmp_path / "frames.npz", **inputs)
    args = ["--inputs", str(tmp_path / "frames.npz"), "--out", str(tmp_path / "pixels.npz")]
    if crop_fraction is not None:
        args += ["--crop-fraction", str(crop_fraction), "--edge", str(edge)]
    done = reference(*args, lerobot="lerobot061", script=SCRIPT)
    assert sorted(done["names"]) == sorted(inputs) and all(g == [1, 16, 16] for g in done["grids"].values())
    spec = PreprocessSpec(resolution=(256, 256), tile_size=(256, 256), resize="stretch", interpolation="bicubic",
                          crop_fraction=230 / 256 if crop_fraction is None else crop_fraction, crop_edge=edge or 0)
    pre = Preprocessor(spec)
    worst = {}
    with np.load(tmp_path / "pixels.npz", allow_pickle=False) as theirs:
        for name, frame in inputs.items():
            ours = pre(frame)
            assert ours.shape == (1, 3, 256, 256) and theirs[name].shape == (3, 256, 256)
            worst[name] = float(np.abs(ours[0] - theirs[name]).max())
    print("max abs difference per frame:", worst)
    assert max(worst.values()) <= TOLERANCE, worst
