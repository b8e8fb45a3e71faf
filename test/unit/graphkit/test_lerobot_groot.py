"""What the GR00T import refuses, and why, before it reads a weight: GR00T N1.5 checkpoints (LeRobot 0.4 / 0.5), a base
model or backbone that is not a local directory, and image paths the graphs do not run. The import of a real
GR00T N1.7 checkpoint is test/parity/test_groot_lerobot.py."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="the import is build-time code")

from synflux_ros.core.config import ConfigError, from_dict  # noqa: E402
from synflux_ros.graphkit.torch_models import config_from_hf  # noqa: E402
from synflux_ros.graphkit.torch_models.lerobot_groot import _geometry, is_lerobot_groot  # noqa: E402


def write(path, obj) -> None:
    path.write_text(json.dumps(obj))


def base():
    return from_dict({"name": "b", "mode": "vla",
                      "vision": {"resolution": [256, 256], "tile_size": [256, 256], "tokens_per_tile": 64},
                      "llm": {"num_layers": 1, "hidden_dim": 8, "num_heads": 1, "vocab_size": 512,
                              "prefill_buckets": [192], "decode_buckets": [192], "max_seq_len": 192},
                      "action": {"head_type": "flow_matching", "action_dim": 1, "action_horizon": 1}})


def steps(*names, config=None) -> dict:
    return {"name": "policy_preprocessor", "steps": [{"registry_name": n, "config": dict(config or {})}
                                                     for n in names]}


def test_a_groot_n1_5_checkpoint_is_refused_naming_what_the_graphs_lack(tmp_path):
    write(tmp_path / "config.json", {"type": "groot", "base_model_path": "nvidia/GR00T-N1.5-3B",
                                     "tokenizer_assets_repo": "lerobot/eagle2hg-processor-groot-n1p5"})
    write(tmp_path / "policy_preprocessor.json", steps("groot_pack_inputs_v3", "groot_eagle_encode_v3"))
    assert is_lerobot_groot(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        config_from_hf(str(tmp_path), base())
    text = str(err.value)
    for what in ("GR00T N1.5", "Eagle 2.5", "future tokens", "groot_pack_inputs_v3, groot_eagle_encode_v3",
                 "only GR00T N1.7"):
        assert what in text


def test_an_n1_5_base_model_config_is_refused(tmp_path):
    (tmp_path / "base").mkdir()
    write(tmp_path / "base" / "config.json", {"backbone_cfg": {"eagle_path": "NVEagle/eagle_er"}})
    write(tmp_path / "config.json", {"type": "groot", "base_model_path": str(tmp_path / "base")})
    with pytest.raises(ConfigError, match="base model is a GR00T N1.5 checkpoint.*Eagle 2.5"):
        config_from_hf(str(tmp_path), base())


@pytest.mark.parametrize("where", ["base_model_path", "model_name"])
def test_a_hub_name_is_refused_with_the_directory_it_needs(tmp_path, where):
    (tmp_path / "base").mkdir()
    write(tmp_path / "base" / "config.json", {"model_name": "nvidia/Cosmos-Reason2-2B"})
    write(tmp_path / "config.json", {"type": "groot", "base_model_path": "nvidia/GR00T-N1.7-3B"
                                     if where == "base_model_path" else str(tmp_path / "base")})
    with pytest.raises(ConfigError, match=f"{where} 'nvidia/.*' is not a local directory.*--local-dir DIR"):
        config_from_hf(str(tmp_path), base())


def test_image_geometry_from_the_vlm_step(tmp_path):
    write(tmp_path / "policy_preprocessor.json",
          steps("groot_n1_7_vlm_encode_v1", config={"image_crop_size": [230, 230], "image_target_size": [256, 256],
                                                    "shortest_image_edge": None, "crop_fraction": None}))
    assert _geometry(str(tmp_path)) == {"resolution": [256, 256], "tile_size": [256, 256], "resize": "stretch",
                                        "interpolation": "bicubic", "crop_fraction": 230 / 256, "crop_edge": 0}
    write(tmp_path / "policy_preprocessor.json",
          steps("groot_n1_7_vlm_encode_v1", config={"use_albumentations": True}))
    with pytest.raises(ConfigError, match="use_albumentations: the albumentations image path"):
        _geometry(str(tmp_path))


def test_action_decodings_the_runtime_does_not_do_are_refused(tmp_path):
    from synflux_ros.graphkit.torch_models.lerobot_groot import _decode_step
    post = tmp_path / "policy_postprocessor.json"
    write(post, steps("groot_n1_7_action_decode_v1"))
    with pytest.raises(ConfigError, match="base model's statistics per modality group"):
        _decode_step(str(tmp_path))
    write(post, steps("groot_action_unpack_unnormalize_v2", config={"libero_gripper_action": True}))
    with pytest.raises(ConfigError, match="libero_gripper_action: LIBERO's gripper transform"):
        _decode_step(str(tmp_path))
    write(post, steps("device_processor"))
    with pytest.raises(ConfigError, match="no groot_action_unpack_unnormalize_v2 step"):
        _decode_step(str(tmp_path))
    write(post, steps("groot_action_unpack_unnormalize_v2", config={"clip_normalized_action": True}))
    assert _decode_step(str(tmp_path))["registry_name"] == "groot_action_unpack_unnormalize_v2"
