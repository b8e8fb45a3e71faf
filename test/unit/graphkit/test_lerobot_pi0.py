"""The import of LeRobot pi0 checkpoints (build/torch_models/lerobot_pi0.py) without LeRobot: a checkpoint
directory written here in LeRobot's layout (key names, config.json fields, processor files with a normaliser
state file) from seeded random tensors. The config takes the sizes, cameras and statistics from it, the
weights land where the graphs read them, and what does not fit is refused with the reason. (Against LeRobot
itself: parity/test_pi0_lerobot.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from synflux_ros.graphkit.torch_models import build_graph_modules, config_from_hf  # noqa: E402
from synflux_ros.core.config import ConfigError, load_config  # noqa: E402
from checkpoints import flow_head_shapes, siglip_shapes, write_lerobot_processors  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
JOINTS = [f"j{i}" for i in range(5)]
W, E, HD, LAYERS, VW = 64, 48, 16, 2, 32
VLM = "model.paligemma_with_expert.paligemma.model.language_model."
VIS = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model."
EXP = "model.paligemma_with_expert.gemma_expert.model."


def gemma_layers(prefix: str, width: int, mlp: int) -> dict:
    t = {}
    for i in range(LAYERS):
        p = f"{prefix}layers.{i}."
        t.update({p + "self_attn.q_proj.weight": (8 * HD, width), p + "self_attn.k_proj.weight": (HD, width),
                  p + "self_attn.v_proj.weight": (HD, width), p + "self_attn.o_proj.weight": (width, 8 * HD),
                  p + "mlp.gate_proj.weight": (mlp, width), p + "mlp.up_proj.weight": (mlp, width),
                  p + "mlp.down_proj.weight": (width, mlp), p + "input_layernorm.weight": (width,),
                  p + "post_attention_layernorm.weight": (width,)})
    t[prefix + "norm.weight"] = (width,)
    return t


def shapes() -> dict:
    t = {"model.paligemma_with_expert.paligemma.lm_head.weight": (257152, W),
         "model.paligemma_with_expert.paligemma.model.multi_modal_projector.linear.weight": (W, VW),
         "model.paligemma_with_expert.paligemma.model.multi_modal_projector.linear.bias": (W,),
         "model.paligemma_with_expert.gemma_expert.lm_head.weight": (257152, E),  # unused by pi0, saved anyway
         **siglip_shapes(VIS, VW, LAYERS, 64, 14, 16), **flow_head_shapes(E, E)}
    t.update(gemma_layers(VLM, W, 128))
    t.update(gemma_layers(EXP, E, 96))
    return t


def write_checkpoint(d: Path, cameras=("top", "wrist"), state_mode="MEAN_STD", drop: str = "") -> dict:
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=gen) * 0.1 for k, s in shapes().items() if k != drop}
    safetensors_torch.save_file(tensors, str(d / "model.safetensors"))
    feats = {f"observation.images.{c}": {"type": "VISUAL", "shape": [3, 56, 56]} for c in cameras}
    feats["observation.state"] = {"type": "STATE", "shape": [len(JOINTS)]}
    (d / "config.json").write_text(json.dumps({
        "type": "pi0", "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m",
        "input_features": feats, "output_features": {"action": {"type": "ACTION", "shape": [6]}},
        "chunk_size": 12, "num_inference_steps": 5, "image_resolution": [56, 56], "tokenizer_max_length": 20,
        "max_state_dim": 32, "max_action_dim": 32}))
    stats = {"observation.state.mean": torch.arange(5.0), "observation.state.std": torch.full((5,), 2.0),
             "observation.state.q01": torch.zeros(5), "observation.state.q99": torch.ones(5),
             "action.mean": torch.zeros(6), "action.std": torch.ones(6), "action.min": -torch.ones(6),
             "action.max": torch.ones(6)}
    write_lerobot_processors(d, stats, {"VISUAL": "IDENTITY", "STATE": state_mode, "ACTION": "MIN_MAX"})
    return tensors


def base(**action):
    cfg = load_config(str(CONFIG_DIR / "vla_pi0.yaml"))
    return cfg.with_overrides(action={"state_joints": JOINTS, **action},
                              vision={"hidden_dim": VW, "num_heads": 4},
                              llm={"num_heads": 8, "head_dim": HD, "num_kv_heads": 1})


def test_the_config_comes_from_the_checkpoint(tmp_path):
    write_checkpoint(tmp_path)
    cfg = config_from_hf(str(tmp_path), base())
    v, llm, act = cfg.vision, cfg.llm, cfg.action
    assert v.cameras == ("top", "wrist") and v.resolution == (56, 56) and v.tokens_per_tile == 16
    assert (v.hidden_dim, v.num_layers, v.num_heads, v.intermediate_size) == (VW, LAYERS, 4, 64)
    assert (llm.hidden_dim, llm.num_layers, llm.num_heads, llm.num_kv_heads, llm.head_dim) == (W, LAYERS, 8, 1, HD)
    assert llm.architecture == "gemma" and llm.prefill_attention == "bidirectional" and llm.tie_word_embeddings
    assert llm.prefill_buckets == (2 * 16 + 20,) and llm.max_seq_len == 52  # two cameras + tokenizer_max_length
    assert (act.action_dim, act.output_dim, act.state_dim, act.action_horizon, act.num_denoise_steps) == \
        (32, 6, 32, 12, 5)
    assert (act.expert_hidden_dim, act.expert_intermediate_size) == (E, 96)
    assert act.state_norm.mode == "mean_std" and act.state_norm.mean == (0.0, 1.0, 2.0, 3.0, 4.0)
    assert act.action_norm.mode == "bounds" and act.action_norm.low == (-1.0,) * 6  # MIN_MAX
    assert cfg.tokenizer.max_instruction_tokens == 20 and cfg.tokenizer.instruction_bos == "<bos>"
    quant = tmp_path / "q"
    quant.mkdir()
    write_checkpoint(quant, state_mode="QUANTILES")
    sn = config_from_hf(str(quant), base()).action.state_norm
    assert sn.mode == "bounds" and sn.high == (1.0,) * 5


def test_the_weights_land_where_the_graphs_read_them(tmp_path):
    tensors = write_checkpoint(tmp_path)
    cfg = config_from_hf(str(tmp_path), base())
    gm = build_graph_modules(cfg, hf_dir=str(tmp_path))
    assert gm.source["model_type"] == "lerobot_pi0" and not gm.source["random"]
    vision = gm.modules["vision_encoder"]
    lm = gm.modules[f"prefill_{cfg.llm.prefill_buckets[0]}"].lm
    expert = gm.modules[f"action_expert_{cfg.llm.decode_buckets[0]}"].expert
    pairs = [(vision.embeddings.position_embedding, VIS + "embeddings.position_embedding.weight"),
             (vision.encoder[1].mlp.fc2.weight, VIS + "encoder.layers.1.mlp.fc2.weight"),
             (vision.multi_modal_projector.bias,
              "model.paligemma_with_expert.paligemma.model.multi_modal_projector.linear.bias"),
             (lm.model.embed_tokens.weight, "model.paligemma_with_expert.paligemma.lm_head.weight"),  # tied
             (lm.model.layers[1].mlp.down_proj.weight, VLM + "layers.1.mlp.down_proj.weight"),
             (expert.layers[0].self_attn.k_proj.weight, EXP + "layers.0.self_attn.k_proj.weight"),
             (expert.norm.weight, EXP + "norm.weight"),
             (expert.state_proj.weight, "model.state_proj.weight"),
             (expert.action_time_mlp_in.weight, "model.action_time_mlp_in.weight")]
    for param, key in pairs:
        torch.testing.assert_close(param.detach(), tensors[key], rtol=0, atol=0, msg=key)


def test_what_does_not_fit_is_refused_with_the_reason(tmp_path):
    write_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="the checkpoint's state has 5 values; list their 5 joint names"):
        config_from_hf(str(tmp_path), base(state_joints=["a", "b"]))
    missing = tmp_path / "missing"
    missing.mkdir()
    write_checkpoint(missing, drop=EXP + "layers.1.mlp.up_proj.weight")
    cfg = config_from_hf(str(missing), base())
    with pytest.raises(ConfigError, match="does not match pi0's action expert of this config: missing "
                                          "\\['layers.1.mlp.up_proj.weight'\\]"):
        build_graph_modules(cfg, hf_dir=str(missing))
    odd = tmp_path / "odd"
    odd.mkdir()
    write_checkpoint(odd, state_mode="PERCENTILE")
    with pytest.raises(ConfigError, match="normalisation mode 'PERCENTILE' for STATE is not supported"):
        config_from_hf(str(odd), base())
    nocam = tmp_path / "nocam"
    nocam.mkdir()
    write_checkpoint(nocam, cameras=())
    with pytest.raises(ConfigError, match="input_features names no camera"):
        config_from_hf(str(nocam), base())
    # without processor statistics LeRobot leaves values unchanged, and so does the import
    for f in tmp_path.glob("policy_*"):
        f.unlink()
    act = config_from_hf(str(tmp_path), base()).action
    assert act.state_norm is None and act.action_norm is None


def test_a_checkpoint_without_the_model_prefix_loads_too(tmp_path):
    tensors = write_checkpoint(tmp_path)
    safetensors_torch.save_file({k[len("model."):]: v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    cfg = config_from_hf(str(tmp_path), base())
    gm = build_graph_modules(cfg, hf_dir=str(tmp_path))
    expert = gm.modules[f"action_expert_{cfg.llm.decode_buckets[0]}"].expert
    np.testing.assert_array_equal(expert.action_out_proj.weight.numpy(), tensors["model.action_out_proj.weight"])


def test_a_pi0_fast_checkpoint_imports_as_the_fast_codec(tmp_path):
    """pi0-FAST: PaliGemma alone (no expert), the state in the prompt, FAST tokens decoded with the tokenizer of
    fast/ beside the checkpoint; what it cannot run is refused with the reason."""
    from synflux_ros.model.normalization import PI0_FAST_PROMPT
    tensors = write_checkpoint(tmp_path)
    safetensors_torch.save_file({k: v for k, v in tensors.items() if "gemma_expert" not in k
                                 and not k.startswith(("model.state_proj", "model.action_"))},
                                str(tmp_path / "model.safetensors"))
    top = json.loads((tmp_path / "config.json").read_text())
    top.update({"type": "pi0_fast", "n_action_steps": 8, "max_decoding_steps": 64, "tokenizer_max_length": 30})
    (tmp_path / "config.json").write_text(json.dumps(top))
    with pytest.raises(ConfigError, match="the FAST action tokenizer is not in .*fast: put the files of"):
        config_from_hf(str(tmp_path), base())
    (tmp_path / "fast").mkdir()
    (tmp_path / "fast" / "tokenizer.json").write_text("{}")
    (tmp_path / "fast" / "processor_config.json").write_text(json.dumps({"scale": 12, "min_token": -300}))
    (tmp_path / "fast" / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": True}))
    cfg = config_from_hf(str(tmp_path), base())
    act, llm = cfg.action, cfg.llm
    assert (act.head_type, act.token_codec, act.action_dim, act.action_horizon, act.state_input) == \
        ("autoregressive", "fast", 6, 8, "prompt")
    assert (act.fast_scale, act.fast_min_token, act.fast_clean_up_spaces, act.max_decoding_steps) == \
        (12.0, -300, True, 64)
    assert act.fast_tokenizer == str(tmp_path / "fast" / "tokenizer.json")
    prefix = 2 * 16 + 30 + 1  # two cameras, the prompt, the second <bos>
    assert llm.prefill_buckets == (prefix,) and llm.max_seq_len == -(-(prefix + 64) // 8) * 8
    assert (cfg.tokenizer.prompt_template, cfg.tokenizer.prompt_end_token) == (PI0_FAST_PROMPT, "<bos>")
    gm = build_graph_modules(cfg, hf_dir=str(tmp_path))
    assert gm.source["model_type"] == "lerobot_pi0_fast" and any(n.startswith("decode_") for n in gm.modules)
    for key, value, needle in (("temperature", 0.7, "only greedy decoding"),
                               ("validate_action_token_prefix", False, "validate_action_token_prefix: false")):
        (tmp_path / "config.json").write_text(json.dumps({**top, key: value}))
        with pytest.raises(ConfigError, match=needle):
            config_from_hf(str(tmp_path), base())


def as_lerobot_06(d: Path, relative: bool = False, names=None, **fields) -> None:
    """Make the checkpoint in ``d`` look as LeRobot 0.6 saves it: its new config.json fields, and the relative-actions
    steps before the normaliser (which moves the normaliser's state file to another step) and after the
    unnormaliser."""
    top = json.loads((d / "config.json").read_text())
    top.update({"pretrained_revision": None, "use_relative_actions": relative, "relative_exclude_joints": ["gripper"],
                "action_feature_names": None, **fields})
    (d / "config.json").write_text(json.dumps(top))
    for name, relative_step in (("policy_preprocessor", "relative_actions_processor"),
                                ("policy_postprocessor", "absolute_actions_processor")):
        pipeline = json.loads((d / f"{name}.json").read_text())
        steps = pipeline["steps"]
        step = {"registry_name": relative_step, "config": {"enabled": relative}}
        if relative_step == "relative_actions_processor":
            step["config"].update(exclude_joints=["gripper"], action_names=names)
        at = len(steps) - 1 if name == "policy_preprocessor" else 1
        steps.insert(at, step)
        for i, s in enumerate(steps):
            if s.get("state_file"):
                moved = f"{name}_step_{i}_{s['registry_name']}.safetensors"
                (d / s["state_file"]).rename(d / moved)
                s["state_file"] = moved
        (d / f"{name}.json").write_text(json.dumps(pipeline))


def test_a_lerobot_06_checkpoint_imports_as_its_release_runs_it(tmp_path):
    """LeRobot 0.6's checkpoints: the normaliser's state file at another step, the true state in pi0.5's and
    pi0-FAST's prompts, PaliGemma's head saved apart from the embedding table (each loads as itself where logits
    are read), actions relative to the state where the relative-actions step's mask says."""
    write_checkpoint(tmp_path)
    as_lerobot_06(tmp_path)
    assert json.loads((tmp_path / "policy_preprocessor.json").read_text())["steps"][6]["state_file"].endswith(
        "step_6_normalizer_processor.safetensors")
    act = config_from_hf(str(tmp_path), base()).action
    assert act.state_norm.mean == (0.0, 1.0, 2.0, 3.0, 4.0) and act.prompt_state == "padded"  # pi0: a state token
    assert act.relative_mask == ()

    fast = tmp_path / "fast06"
    fast.mkdir()
    tensors = write_checkpoint(fast)
    table = torch.randn(257152, W, generator=torch.Generator().manual_seed(1)) * 0.1
    kept = {k: v for k, v in tensors.items() if "gemma_expert" not in k
            and not k.startswith(("model.state_proj", "model.action_"))}
    safetensors_torch.save_file({**kept, VLM + "embed_tokens.weight": table}, str(fast / "model.safetensors"))
    top = json.loads((fast / "config.json").read_text())
    (fast / "config.json").write_text(json.dumps({**top, "type": "pi0_fast", "max_decoding_steps": 16}))
    (fast / "fast").mkdir()
    (fast / "fast" / "tokenizer.json").write_text("{}")
    (fast / "fast" / "processor_config.json").write_text(json.dumps({"scale": 10, "min_token": -300}))
    assert config_from_hf(str(fast), base()).action.prompt_state == "padded"  # before: LeRobot 0.4's prompt
    as_lerobot_06(fast)
    cfg = config_from_hf(str(fast), base())
    assert cfg.action.prompt_state == "joints" and not cfg.llm.tie_word_embeddings
    lm = build_graph_modules(cfg, hf_dir=str(fast)).modules[f"prefill_{cfg.llm.prefill_buckets[0]}"].lm
    torch.testing.assert_close(lm.model.embed_tokens.weight.detach(), table, rtol=0, atol=0)
    torch.testing.assert_close(lm.lm_head.weight.detach(), kept["model.paligemma_with_expert.paligemma.lm_head.weight"],
                               rtol=0, atol=0)
    # the same table saved twice (a tied model) stays one matrix
    safetensors_torch.save_file({**kept, VLM + "embed_tokens.weight": kept[
        "model.paligemma_with_expert.paligemma.lm_head.weight"].clone()}, str(fast / "model.safetensors"))
    assert config_from_hf(str(fast), base()).llm.tie_word_embeddings

    # actions relative to the state: LeRobot's mask (exclude_joints tokens found in the action names); the state
    # needs a value for every action, the flag and the steps must agree
    state6 = base(state_joints=[f"j{i}" for i in range(6)])
    for names, want in ((None, (True,) * 6), (["a", "b", "c", "d", "e", "Left_Gripper"], (True,) * 5 + (False,)),
                        (["gripper_a", "b"], (False,) + (True,) * 5)):
        relative = tmp_path / f"relative-{len(names or [])}"
        relative.mkdir()
        write_checkpoint(relative, state_mode="IDENTITY")  # (the statistics are of 5 state values)
        top = json.loads((relative / "config.json").read_text())
        top["input_features"]["observation.state"]["shape"] = [6]
        (relative / "config.json").write_text(json.dumps(top))
        as_lerobot_06(relative, relative=True, names=names)
        assert config_from_hf(str(relative), state6).action.relative_mask == want
    small = tmp_path / "relative-small"
    small.mkdir()
    write_checkpoint(small)
    as_lerobot_06(small, relative=True)
    with pytest.raises(ConfigError, match="adds state value i to action i, but the state has 5 values for 6"):
        config_from_hf(str(small), base())
    top = json.loads((relative / "config.json").read_text())
    (relative / "config.json").write_text(json.dumps({**top, "use_relative_actions": False}))
    with pytest.raises(ConfigError, match="use_relative_actions is False, but the saved postprocessor's "
                                          "absolute_actions_processor is enabled"):
        config_from_hf(str(relative), state6)
