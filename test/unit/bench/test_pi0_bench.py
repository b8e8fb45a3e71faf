"""The chunk-latency bench's argument handling: each policy's sizes, cameras and reference script."""
import pytest

from synflux_ros.bench import pi0


def parse(*argv):
    return pi0.parse_args(["--ref-python", "python", *argv])


def test_groot_defaults_to_its_checkpoints_cameras_and_joints():
    args = parse("--ref-script", "test/reference/lerobot_groot.py", "--policy", "groot", "--size", "wide")
    assert args.cameras == ["base", "wrist"]
    assert len(pi0.joints(args)) == 7 and pi0.camera_shape(args) == (240, 320)
    assert pi0.sizes(args)["text_hidden"] == 2048 and pi0.steps_of(args) == 4
    assert pi0.tokens_per_camera(args) == 64


def test_groot_per_camera_builds_its_own_set_of_one_image_vision_calls(tmp_path):
    import yaml
    argv = ("--ref-script", "lerobot_groot.py", "--policy", "groot", "--work", str(tmp_path))
    one, per = parse(*argv), parse(*argv, "--per-camera")
    assert pi0._stem(one) != pi0._stem(per) and "one vision call" in pi0.describe(one)
    for args, batched in ((one, True), (per, False)):
        raw = yaml.safe_load(open(pi0.base_config(str(tmp_path / "base.yaml"), args)))
        assert raw["vision"]["batch_cameras"] is batched


def test_pi0_keeps_its_defaults():
    args = parse("--ref-script", "lerobot_pi0.py", "--policy", "pi05")
    assert args.cameras == ["base"] and args.size == "small" and len(pi0.joints(args)) == 8
    assert pi0.camera_shape(args) == (224, 224) and pi0.steps_of(args) == 10


@pytest.mark.parametrize("argv", [
    ("--ref-script", "lerobot_pi0.py", "--policy", "groot"),               # GR00T's own reference script
    ("--ref-script", "lerobot_groot.py", "--policy", "groot", "--size", "tiny"),  # no tiny GR00T
    ("--ref-script", "lerobot_pi0.py", "--policy", "pi0", "--size", "wide"),
    ("--ref-script", "lerobot_groot.py", "--policy", "groot", "--cameras", "base"),
    ("--ref-script", "lerobot_pi0.py", "--pools", "none"),
    ("--ref-script", "lerobot_pi0.py", "--per-camera"),                      # GR00T's option
])
def test_rejects(argv):
    with pytest.raises(SystemExit):
        parse(*argv)
