"""The antialiased bicubic resize and centre crop of synflux_ros.model.image (LeRobot GR00T N1.7's geometry),
checked against properties that hold only when the kernel, its support, the fixed point and the crop are right.
The comparison with LeRobot itself is test/parity/test_groot_image_lerobot.py."""

import numpy as np
import pytest

from synflux_ros.core.config import ConfigError, PreprocessSpec, load_config
from synflux_ros.model.image import Preprocessor, cubic_weights


def _spec(resolution, **kw):
    kw = {"resize": "stretch", "interpolation": "bicubic", "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0), **kw}
    return PreprocessSpec(resolution=resolution, tile_size=resolution, **kw)


def _grey(out):
    """The single tile [1, 3, H, W] of x / 255 back to uint8 grey levels (exact: k / 255 * 255 rounds to k)."""
    return np.rint(out[0] * 255).astype(np.int64)


def test_constant_frame_stays_constant():
    rng = np.random.default_rng(0)
    for (h, w), res, crop in [((480, 640), (256, 256), 230 / 256), ((37, 91), (64, 48), 1.0), ((5, 3), (40, 40), 0.5)]:
        value = rng.integers(0, 256, 3)
        frame = np.broadcast_to(value.astype(np.uint8), (h, w, 3)).copy()
        out = _grey(Preprocessor(_spec(res, crop_fraction=crop))(frame))
        assert (out == value[:, None, None]).all(), (h, w, res)


def test_weights_sum_to_one_in_fixed_point():
    for n_in, n_out in [(230, 256), (640, 256), (480, 256), (256, 230), (3, 17), (1000, 7)]:
        weights, precision = cubic_weights(n_in, n_out)
        sums = weights.sum(axis=1)
        # Each row is rounded tap by tap from weights summing to 1: off by at most half a unit per tap.
        taps = (weights != 0).sum(axis=1)
        assert (np.abs(sums - (1 << precision)) <= taps).all(), (n_in, n_out)
        assert weights.max() < (1 << 15) <= 2 * weights.max() + 1, (n_in, n_out, precision)


def test_upscaling_keeps_a_ramp_linear_away_from_the_borders():
    # Keys' cubic (a = -0.5) reproduces linear functions exactly, so away from the borders (where taps fall
    # outside the frame and the rest are renormalised) a ramp of one grey level per input pixel comes out as the
    # line through the output centres, rounded: within half a grey level of it (plus the fixed point's rounding).
    w_in, w_out = 230, 256
    ramp = np.arange(w_in, dtype=np.uint8) + 13
    frame = np.broadcast_to(ramp[None, :, None], (4, w_in, 3)).copy()
    out = _grey(Preprocessor(_spec((4, w_out)))(frame))
    assert (out == out[:1, :1]).all(axis=(0, 1)).all()  # rows and channels alike
    line = 13 + (np.arange(w_out) + 0.5) * w_in / w_out - 0.5
    inner = slice(3, w_out - 3)
    assert np.abs(out[0, 0, inner] - line[inner]).max() <= 0.5 + 1e-9
    # Downscaling (antialiased: 8 taps per output here) keeps it linear too.
    out = _grey(Preprocessor(_spec((4, 100)))(frame))
    line = 13 + (np.arange(100) + 0.5) * w_in / 100 - 0.5
    assert np.abs(out[0, 0, 3:-3] - line[3:-3]).max() <= 0.5 + 1e-9


def test_same_size_without_crop_is_the_identity():
    frame = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = _grey(Preprocessor(_spec((48, 64)))(frame))
    np.testing.assert_array_equal(out, frame.transpose(2, 0, 1))
    # One axis resized: the other is untouched (its weights would be the identity too).
    weights, precision = cubic_weights(9, 9)
    np.testing.assert_array_equal(weights, np.eye(9, dtype=np.int64) << precision)


# Keys' cubic with a = -0.5 (1.5|x|^3 - 2.5|x|^2 + 1 below 1, -0.5|x|^3 + 2.5|x|^2 - 4|x| + 2 below 2), by hand.
KEYS = {0.25: 0.8671875, 0.75: 0.2265625, 1.25: -0.0703125, 1.75: -0.0234375}


def _fixed(raw, precision):
    """Normalise one output's taps to sum 1 and round them half away from zero at 2**precision."""
    w = np.array(raw) / sum(raw) * (1 << precision)
    return np.where(w < 0, np.trunc(w - 0.5), np.trunc(w + 0.5)).astype(np.int64)


def test_weights_of_a_tiny_case_by_hand():
    assert sum(KEYS.values()) == 1.0  # the four taps at quarter offsets partition unity
    # 2 -> 4, upscaling: output i is centred on input coordinate c = (i + 0.5) / 2 (pixel j spans [j, j + 1]),
    # i.e. 0.25, 0.75, 1.25, 1.75; both inputs are taps (support 2), at offsets j + 0.5 - c. Output 0: 0.25 and
    # 1.25; output 1: 0.25 and 0.75; outputs 2 and 3 mirror them. The largest normalised weight is
    # 0.8671875 / 0.796875 = 1.088, so 2**14 is the largest scale keeping it below 2**15.
    weights, precision = cubic_weights(2, 4)
    assert precision == 14
    rows = [[KEYS[0.25], KEYS[1.25]], [KEYS[0.25], KEYS[0.75]], [KEYS[0.75], KEYS[0.25]], [KEYS[1.25], KEYS[0.25]]]
    np.testing.assert_array_equal(weights, [_fixed(r, 14) for r in rows])
    assert weights[0].tolist() == [17830, -1446]
    # 4 -> 2, downscaling by 2: the kernel is stretched by 2 (support 4), so output 0 (c = 1.0) reads all four
    # inputs at offsets (j + 0.5 - 1) / 2 = -0.25, 0.25, 0.75, 1.25. Largest weight 0.8671875 / 1.890625 =
    # 0.459: scale 2**16.
    weights, precision = cubic_weights(4, 2)
    assert precision == 16
    first = [KEYS[0.25], KEYS[0.25], KEYS[0.75], KEYS[1.25]]
    np.testing.assert_array_equal(weights, [_fixed(first, 16), _fixed(first[::-1], 16)])


@pytest.mark.parametrize("edge,fraction,offset,side", [(256, 230 / 256, 13, 230), (255, 230 / 256, 13, 229),
                                                      (224, 0.5, 56, 112), (10, 0.25, 4, 2), (9, 0.05, 4, 1)])
def test_crop_window(edge, fraction, offset, side):
    spec = _spec((edge, edge), crop_fraction=fraction)
    assert spec.crop_window() == (edge, offset, side)
    # round() of the side (half to even as Python's), floor of the offset: 255 * 230/256 = 229.1 -> 229, (255 -
    # 229) // 2 = 13; 10 * 0.25 = 2.5 -> 2, (10 - 2) // 2 = 4.


def test_crop_keeps_the_centred_window():
    # A frame already at the square's size, cropped and resized back: equal to resizing the window alone.
    rng = np.random.default_rng(2)
    frame = rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)
    cropped = _grey(Preprocessor(_spec((256, 256), crop_fraction=230 / 256))(frame))
    window = np.ascontiguousarray(frame[13:243, 13:243])
    direct = _grey(Preprocessor(_spec((256, 256)))(window))
    np.testing.assert_array_equal(cropped, direct)
    shifted = _grey(Preprocessor(_spec((256, 256)))(np.ascontiguousarray(frame[14:244, 14:244])))
    assert (shifted != cropped).any()
    # crop_edge: stretched to 128 first, then the window of 115 (round(128 * 0.8984375) = 115, offset 6).
    spec = _spec((256, 256), crop_fraction=230 / 256, crop_edge=128)
    assert spec.crop_window() == (128, 6, 115)
    small = _grey(Preprocessor(_spec((128, 128)))(frame)).transpose(1, 2, 0).astype(np.uint8)
    direct = _grey(Preprocessor(_spec((256, 256)))(np.ascontiguousarray(small[6:121, 6:121])))
    np.testing.assert_array_equal(_grey(Preprocessor(spec)(frame)), direct)


def test_normalisation_and_tiles_follow_the_spec():
    frame = np.random.default_rng(3).integers(0, 256, (100, 80, 3), dtype=np.uint8)
    plain = Preprocessor(_spec((64, 64), crop_fraction=0.75))(frame)
    spec = PreprocessSpec(resolution=(64, 64), tile_size=(32, 32), resize="stretch", interpolation="bicubic",
                          crop_fraction=0.75, mean=(0.5, 0.4, 0.3), std=(0.5, 0.25, 0.2))
    tiled = Preprocessor(spec)(frame)
    assert tiled.shape == (4, 3, 32, 32)
    whole = tiled.reshape(2, 2, 3, 32, 32).transpose(2, 0, 3, 1, 4).reshape(3, 64, 64)
    mean, std = np.array(spec.mean)[:, None, None], np.array(spec.std)[:, None, None]
    np.testing.assert_allclose(whole, (plain[0] - mean) / std, atol=1e-5)


def test_bicubic_with_letterbox_fills_the_window_only():
    frame = np.full((50, 100, 3), 200, np.uint8)
    spec = PreprocessSpec(resolution=(64, 64), tile_size=(64, 64), resize="letterbox", interpolation="bicubic",
                          pad_value=0, mean=(0, 0, 0), std=(1, 1, 1))
    out = _grey(Preprocessor(spec)(frame))
    assert (out[:, 16:48] == 200).all() and (out[:, :16] == 0).all() and (out[:, 48:] == 0).all()


def test_sizes_are_cached_and_frames_of_other_sizes_follow():
    pre = Preprocessor(_spec((32, 32), crop_fraction=0.5), max_cached_sizes=2)
    rng = np.random.default_rng(4)
    frames = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in [(40, 60, 3), (20, 20, 3)]]
    outs = [pre(f) for f in [*frames, frames[0]]]
    np.testing.assert_array_equal(outs[0], outs[2])
    assert len(pre._plans) == 2
    fresh = Preprocessor(_spec((32, 32), crop_fraction=0.5))(frames[1])
    np.testing.assert_array_equal(outs[1], fresh)


@pytest.mark.parametrize("kw,needle", [({"crop_fraction": 0.0}, "crop_fraction"),
                                       ({"crop_fraction": 1.5}, "crop_fraction"),
                                       ({"crop_fraction": "x"}, "crop_fraction"),
                                       ({"crop_edge": -1}, "crop_edge"),
                                       ({"crop_edge": 2.5}, "crop_edge"),
                                       ({"crop_fraction": 0.5, "interpolation": "bilinear"}, "bicubic"),
                                       ({"crop_edge": 64, "resize": "letterbox"}, "stretch")])
def test_spec_rejects(kw, needle):
    with pytest.raises(ValueError, match=needle):
        _spec((32, 32), **kw)


def test_existing_specs_are_unchanged():
    spec = PreprocessSpec(resolution=(448, 448), tile_size=(224, 224))
    assert (spec.interpolation, spec.crop_fraction, spec.crop_edge, spec.cropped) == ("bilinear", 1.0, 0, False)


def _vision_yaml(tmp_path, vision: dict) -> str:
    import yaml
    raw = {"name": "t", "mode": "vla",
           "vision": {"resolution": [256, 256], "tile_size": [256, 256], "tokens_per_tile": 64, **vision},
           "llm": {"num_layers": 1, "hidden_dim": 32, "num_heads": 2, "vocab_size": 64, "prefill_buckets": [128],
                   "decode_buckets": [256], "max_seq_len": 256},
           "action": {"head_type": "flow_matching", "action_dim": 4, "action_horizon": 4, "state_dim": 4,
                      "state_joints": ["a", "b", "c", "d"]}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_vision_config_carries_the_crop(tmp_path):
    cfg = load_config(_vision_yaml(tmp_path, {"resize": "stretch", "interpolation": "bicubic",
                                              "crop_fraction": 0.8984375, "crop_edge": 256}))
    assert (cfg.vision.crop_fraction, cfg.vision.crop_edge) == (0.8984375, 256)
    default = load_config(_vision_yaml(tmp_path, {}))
    assert (default.vision.crop_fraction, default.vision.crop_edge, default.vision.interpolation) == (1.0, 0,
                                                                                                     "bilinear")


@pytest.mark.parametrize("vision,field", [({"crop_fraction": 0.0}, "vision.crop_fraction"),
                                          ({"crop_fraction": 1.2}, "vision.crop_fraction"),
                                          ({"crop_fraction": 0.5}, "vision.crop_fraction"),
                                          ({"crop_edge": 64, "interpolation": "bicubic"}, "vision.crop_edge"),
                                          ({"crop_edge": -3}, "vision.crop_edge")])
def test_vision_config_names_the_bad_field(tmp_path, vision, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(_vision_yaml(tmp_path, vision))
