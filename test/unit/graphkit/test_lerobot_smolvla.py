"""The import of LeRobot SmolVLA checkpoints (build/torch_models/lerobot_smolvla.py) without LeRobot: a checkpoint
directory written here in LeRobot's layout (key names, config.json fields, processor files with a normaliser state
file) from seeded random tensors. The config takes the sizes, cameras, layer pattern and statistics from it, the
weights land where the graphs read them, and what does not fit is refused with the reason. (Against LeRobot
itself: parity/test_smolvla_lerobot.py.)"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from synflux_ros.graphkit.torch_models import build_graph_modules, config_from_hf  # noqa: E402
from synflux_ros.graphkit.torch_models.lerobot_smolvla import prefill_buckets  # noqa: E402
from synflux_ros.core.config import ConfigError, load_config  # noqa: E402
from checkpoints import flow_head_shapes, siglip_shapes, write_lerobot_processors  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
JOINTS = [f"j{i}" for i in range(5)]
W, HEADS, KV, HD, LAYERS, VW, E, P = 48, 4, 2, 16, 4, 32, 36, 8  # text, expert, vision widths; patch 8
VIS = "model.vlm_with_expert.vlm.model.vision_model."
TEXT = "model.vlm_with_expert.vlm.model.text_model."
EXP = "model.vlm_with_expert.lm_expert."


def llama_layers(prefix: str, width: int, mlp: int, cross=()) -> dict:
    t = {}
    for i in range(LAYERS):
        p = f"{prefix}layers.{i}."
        kv_in = KV * HD if i in cross else width  # a cross-attention layer re-projects the cached keys/values
        t.update({p + "self_attn.q_proj.weight": (HEADS * HD, width), p + "self_attn.k_proj.weight": (KV * HD, kv_in),
                  p + "self_attn.v_proj.weight": (KV * HD, kv_in), p + "self_attn.o_proj.weight": (width, HEADS * HD),
                  p + "mlp.gate_proj.weight": (mlp, width), p + "mlp.up_proj.weight": (mlp, width),
                  p + "mlp.down_proj.weight": (width, mlp), p + "input_layernorm.weight": (width,),
                  p + "post_attention_layernorm.weight": (width,)})
    t[prefix + "norm.weight"] = (width,)
    return t


def shapes(cross=(1, 3)) -> dict:
    t = {"model.vlm_with_expert.vlm.lm_head.weight": (512, W), TEXT + "embed_tokens.weight": (512, W),
         "model.vlm_with_expert.vlm.model.connector.modality_projection.proj.weight": (W, 4 * VW),  # shuffle by 2
         **siglip_shapes(VIS, VW, 2, 64, P, 36), **flow_head_shapes(E, W)}  # the state projects into the prefix
    t.update(llama_layers(TEXT, W, 96))
    t.update(llama_layers(EXP, E, 256, cross))
    return t


def write_checkpoint(d: Path, drop: str = "", cross=(1, 3), cameras=("top", "wrist"), **config) -> dict:
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=gen) * 0.1 for k, s in shapes(cross).items() if k not in drop.split(",")}
    safetensors_torch.save_file(tensors, str(d / "model.safetensors"))
    feats = {f"observation.images.{c}": {"type": "VISUAL", "shape": [3, 48, 48]} for c in cameras}
    feats["observation.state"] = {"type": "STATE", "shape": [len(JOINTS)]}
    (d / "config.json").write_text(json.dumps({
        "type": "smolvla", "vlm_model_name": "HuggingFaceTB/SmolVLM2-500M-Video-Instruct", "input_features": feats,
        "output_features": {"action": {"type": "ACTION", "shape": [6]}}, "chunk_size": 12, "n_action_steps": 12,
        "num_steps": 5, "resize_imgs_with_padding": [48, 48], "tokenizer_max_length": 20, "max_state_dim": 32,
        "max_action_dim": 32, "num_vlm_layers": LAYERS, "num_expert_layers": -1, "attention_mode": "cross_attn",
        "self_attn_every_n_layers": 2, "add_image_special_tokens": False, "min_period": 0.004, "max_period": 4.0,
        **config}))
    stats = {"observation.state.mean": torch.arange(5.0), "observation.state.std": torch.full((5,), 2.0),
             "action.mean": torch.zeros(6), "action.std": torch.ones(6)}
    write_lerobot_processors(d, stats, {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"})
    return tensors


def base(**sections):
    """vla_smolvla.yaml with the small model's heads and epsilons (what SmolVLM's own config would give)."""
    cfg = load_config(str(CONFIG_DIR / "vla_smolvla.yaml"))
    over = {"action": {"state_joints": JOINTS}, "vision": {"hidden_dim": VW, "num_heads": 4, "layer_norm_eps": 1e-5},
            "llm": {"hidden_dim": W, "num_heads": HEADS, "num_kv_heads": KV, "head_dim": HD, "rms_norm_eps": 3e-6}}
    for key, value in sections.items():
        over[key] = {**over.get(key, {}), **value}
    return cfg.with_overrides(**over)


def test_the_config_comes_from_the_checkpoint(tmp_path):
    write_checkpoint(tmp_path, cameras=("top", "wrist", "empty_camera_0"))  # LeRobot's masked-out extra camera
    cfg = config_from_hf(str(tmp_path), base())
    v, llm, act = cfg.vision, cfg.llm, cfg.action
    assert v.cameras == ("top", "wrist") and v.resolution == (48, 48) and v.tokens_per_tile == 9
    assert (v.hidden_dim, v.num_layers, v.num_heads, v.intermediate_size, v.layer_norm_eps) == (VW, 2, 4, 64, 1e-5)
    assert (v.token_merge, v.projector_bias, v.resize) == ("pixel_shuffle", False, "letterbox_bottom_right")
    assert v.output_scale == llm.embed_scale == math.sqrt(W)
    assert (llm.hidden_dim, llm.num_layers, llm.num_heads, llm.num_kv_heads, llm.head_dim) == (W, LAYERS, 4, 2, 16)
    assert (llm.architecture, llm.rope_theta, llm.rms_norm_eps, llm.tie_word_embeddings) == ("llama", 1e4, 3e-6, False)
    # two cameras + tokenizer_max_length + the state row, the cache rounded up to 8 positions
    assert llm.prefill_buckets == (2 * 9 + 20 + 1,) and llm.decode_buckets == (40,) and llm.max_seq_len == 40
    assert (act.action_dim, act.output_dim, act.state_dim, act.action_horizon, act.num_denoise_steps) == \
        (32, 6, 32, 12, 5)
    assert (act.expert_hidden_dim, act.expert_intermediate_size) == (E, 256)
    assert (act.state_input, act.expert_attention, act.self_attn_every_n_layers, act.action_attention) == \
        ("prefix", "cross_attn", 2, "causal")
    assert act.state_norm.mode == act.action_norm.mode == "mean_std" and act.state_norm.std == (2.0,) * 5
    tok = cfg.tokenizer
    assert (tok.prompt_template, tok.instruction_bos, tok.max_instruction_tokens, tok.prompt_special_tokens) == \
        ("{instruction}\n", "", 20, True)
    # SmolVLM2-500M's heads and epsilons where the config's llm / vision sections are not of this width
    real = load_config(str(CONFIG_DIR / "vla_smolvla.yaml")).with_overrides(action={"state_joints": JOINTS})
    with pytest.raises(ConfigError, match="attention projections of 64 / 32 outputs do not fit "
                                          "'HuggingFaceTB/SmolVLM2-500M-Video-Instruct'"):
        config_from_hf(str(tmp_path), real)
    selfattn = tmp_path / "selfattn"
    selfattn.mkdir()
    write_checkpoint(selfattn, cross=(), attention_mode="self_attn", self_attn_every_n_layers=-1)
    assert config_from_hf(str(selfattn), base()).action.expert_attention == "joint"
    allcross = tmp_path / "allcross"
    allcross.mkdir()
    write_checkpoint(allcross, cross=range(LAYERS), self_attn_every_n_layers=-1)  # LeRobot's -1: every layer
    act = config_from_hf(str(allcross), base()).action
    assert act.self_attn_every_n_layers == 0 and all(act.cross_attention_layer(i) for i in range(LAYERS))


def test_short_prompts_take_a_smaller_prefill_bucket():
    # SmolVLA's 2 cameras of 64 tokens and the state row, prompts up to 48 tokens: one of up to 16 saves 18 %
    assert prefill_buckets(129, 48) == [145, 177]
    assert prefill_buckets(65, 48) == [81, 113]  # one camera: 32 tokens would save 14 %, 16 save 28 %
    assert prefill_buckets(19, 48) == [51, 67]  # the largest power of two that saves 15 %
    # no bucket of 16 or more prompt tokens saves 15 %: one bucket (one graph)
    assert prefill_buckets(768, 48) == [816] and prefill_buckets(19, 20) == [39] and prefill_buckets(0, 16) == [16]


def test_the_weights_land_where_the_graphs_read_them(tmp_path):
    tensors = write_checkpoint(tmp_path)
    cfg = config_from_hf(str(tmp_path), base())
    gm = build_graph_modules(cfg, hf_dir=str(tmp_path))
    assert gm.source["model_type"] == "lerobot_smolvla" and not gm.source["random"]
    vision = gm.modules["vision_encoder"]
    prefill = gm.modules[f"prefill_{cfg.llm.prefill_buckets[0]}"]
    expert = gm.modules[f"action_expert_{cfg.llm.decode_buckets[0]}"].expert
    assert expert.cross == [False, True, False, True]
    pairs = [(vision.embeddings.position_embedding, VIS + "embeddings.position_embedding.weight"),
             (vision.encoder[1].mlp.fc2.weight, VIS + "encoder.layers.1.mlp.fc2.weight"),
             (vision.multi_modal_projector.weight,
              "model.vlm_with_expert.vlm.model.connector.modality_projection.proj.weight"),
             (prefill.lm.model.embed_tokens.weight, TEXT + "embed_tokens.weight"),
             (prefill.lm.model.layers[3].mlp.down_proj.weight, TEXT + "layers.3.mlp.down_proj.weight"),
             (prefill.state_proj.weight, "model.state_proj.weight"),
             (prefill.state_proj.bias, "model.state_proj.bias"),
             (expert.layers[1].self_attn.k_proj.weight, EXP + "layers.1.self_attn.k_proj.weight"),  # cross: 32x32
             (expert.layers[2].self_attn.v_proj.weight, EXP + "layers.2.self_attn.v_proj.weight"),
             (expert.norm.weight, EXP + "norm.weight"),
             (expert.action_time_mlp_in.weight, "model.action_time_mlp_in.weight")]
    for param, key in pairs:
        torch.testing.assert_close(param.detach(), tensors[key], rtol=0, atol=0, msg=key)
    assert vision.multi_modal_projector.bias is None
    # a tied table is saved once, under the head's name (safetensors keeps the name that sorts first)
    tied = tmp_path / "tied"
    tied.mkdir()
    tensors = write_checkpoint(tied, drop=TEXT + "embed_tokens.weight")
    cfg = config_from_hf(str(tied), base())
    assert cfg.llm.tie_word_embeddings and cfg.llm.vocab_size == 512
    lm = build_graph_modules(cfg, hf_dir=str(tied)).modules[f"prefill_{cfg.llm.prefill_buckets[0]}"].lm
    torch.testing.assert_close(lm.model.embed_tokens.weight.detach(),
                               tensors["model.vlm_with_expert.vlm.lm_head.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("config,needle", [
    ({"add_image_special_tokens": True}, "tokens around each image"),
    ({"adapt_to_pi_aloha": True}, "Aloha's joint remapping"),
    ({"attention_mode": "cross_attn_all"}, "attention_mode 'cross_attn_all' is not supported"),
    ({"self_attn_every_n_layers": 3}, "expert layer 2 has k_proj of input width 36, which does not fit"),
    ({"num_vlm_layers": 16}, "num_vlm_layers is 16, the checkpoint holds 4"),
    ({"min_period": 0.001}, "min_period / max_period"),
    ({"resize_imgs_with_padding": [512, 512]}, "differs from the vision tower's 48x48 input"),
])
def test_what_does_not_fit_is_refused_with_the_reason(tmp_path, config, needle):
    write_checkpoint(tmp_path, **config)
    with pytest.raises(ConfigError, match=needle):
        config_from_hf(str(tmp_path), base())


def test_missing_tensors_and_joint_names_are_refused(tmp_path):
    write_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="the checkpoint's state has 5 values; list their 5 joint names"):
        config_from_hf(str(tmp_path), base(action={"state_joints": ["a", "b"]}))
    missing = tmp_path / "missing"
    missing.mkdir()
    write_checkpoint(missing, drop="model.state_proj.bias")
    cfg = config_from_hf(str(missing), base())
    with pytest.raises(ConfigError, match=r"does not match SmolVLA's state projection of this config: missing "
                                          r"\['bias'\]"):
        build_graph_modules(cfg, hf_dir=str(missing))
