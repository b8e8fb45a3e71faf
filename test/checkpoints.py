"""Small checkpoint files and graph-set helpers the tests share (the test directory is on sys.path
through its conftest)."""
from __future__ import annotations

import os

from synflux_ros.graphset import reader as graphset
from synflux_ros.core.config import load_config
from synflux_ros.core.contract import GraphMeta


def config(graph_dir: str, backend: str, **options):
    cfg = load_config(os.path.join(graph_dir, "config.yaml"))
    return cfg.with_overrides(executor={"backend": backend, "options": options, "latency_ms": {}})


def metas(graph_dir: str, *names: str) -> list[GraphMeta]:
    all_metas = graphset.graph_metas(graph_dir, graphset.read_manifest(graph_dir))
    return [m for m in all_metas if not names or m.name in names]


def write_tokenizer(path: str, first_specials=()) -> None:
    """A small byte-level BPE tokenizer.json with the chat special tokens, as a checkpoint ships one;
    ``first_specials`` take the ids 0, 1, ... before them (e.g. Gemma's <pad>, <eos>, <bos>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [*first_specials, "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the robot picks up the red block and puts it in the bowl"] * 50, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))


def demo_size(raw: dict) -> dict:
    """Shrink a real-size config's widths; keep its structure (architecture, buckets, heads, dtypes)."""
    llm = raw["llm"]
    if llm["hidden_dim"] <= 256:
        return raw
    llm.update(num_layers=2, hidden_dim=64, num_heads=4, num_kv_heads=min(llm.get("num_kv_heads", 4), 2),
               head_dim=16, intermediate_size=128, vocab_size=1024)
    if llm.get("mrope_section"):  # Qwen3-VL's t:h:w split of the rotary frequencies, for head_dim 16
        llm["mrope_section"] = [4, 2, 2]
    vis = raw.get("vision")
    if vis:  # text-only configs have none
        vis.update(hidden_dim=32, num_layers=1, num_heads=2, intermediate_size=64)
        if vis.get("deepstack_layers"):
            vis["deepstack_layers"] = [0]
    act = raw.get("action")
    if act and act.get("expert_type") == "dit":  # GR00T: the VL blocks as wide as the LLM
        act.update(dit_layers=2, dit_heads=2, dit_head_dim=16, dit_hidden_dim=32, vl_layers=1, vl_heads=4,
                   vl_head_dim=16)
    elif act:
        act.update(expert_hidden_dim=32, expert_intermediate_size=64)
        if act.get("token_vocab_size"):
            act["token_vocab_size"] = 1000
    if raw.get("text", {}).get("eos_token_ids"):
        raw["text"]["eos_token_ids"] = [1000, 1001]
    return raw


# A tiny Qwen3-VL (vision tower + one text layer) for the tests that compare with transformers.
H, W = 128, 96                      # non-square on purpose: 8 x 6 patches of 16 -> 4 x 3 merged tokens
LLM_HIDDEN = 48
MEAN, STD = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)


def tiny_hf_config():
    from transformers import Qwen3VLConfig
    return Qwen3VLConfig(
        vision_config=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=LLM_HIDDEN,
                           deepstack_visual_indexes=[0, 2], num_position_embeddings=49),
        text_config=dict(hidden_size=LLM_HIDDEN, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=24, intermediate_size=64, vocab_size=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [4, 4, 4], "mrope_interleaved": True}),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)


def hf_image_processor(**size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                    image_mean=list(MEAN), image_std=list(STD), **size)


# LeRobot's checkpoint layout, for the import tests that run without LeRobot (test/unit/graphkit/test_lerobot_*.py)

def siglip_shapes(prefix: str, width: int, layers: int, mlp: int, patch: int, positions: int) -> dict:
    """Tensor name -> shape of a SigLIP tower under ``prefix`` (patch and position embeddings, ``layers`` encoder
    layers with biased projections and LayerNorms, the post-LayerNorm)."""
    t = {prefix + "embeddings.patch_embedding.weight": (width, 3, patch, patch),
         prefix + "embeddings.patch_embedding.bias": (width,),
         prefix + "embeddings.position_embedding.weight": (positions, width),
         prefix + "post_layernorm.weight": (width,), prefix + "post_layernorm.bias": (width,)}
    for i in range(layers):
        p = f"{prefix}encoder.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            t[f"{p}self_attn.{n}.weight"], t[f"{p}self_attn.{n}.bias"] = (width, width), (width,)
        for n in ("layer_norm1", "layer_norm2"):
            t[f"{p}{n}.weight"], t[f"{p}{n}.bias"] = (width,), (width,)
        t.update({p + "mlp.fc1.weight": (mlp, width), p + "mlp.fc1.bias": (mlp,), p + "mlp.fc2.weight": (width, mlp),
                  p + "mlp.fc2.bias": (width,)})
    return t


def flow_head_shapes(expert: int, state_out: int, padded: int = 32) -> dict:
    """Tensor name -> shape of the flow-matching projections around the action expert (``expert`` wide; the state
    projection to ``state_out``: pi0's suffix token, SmolVLA's prefix row), on ``padded`` state/action values."""
    return {"model.state_proj.weight": (state_out, padded), "model.state_proj.bias": (state_out,),
            "model.action_in_proj.weight": (expert, padded), "model.action_in_proj.bias": (expert,),
            "model.action_time_mlp_in.weight": (expert, 2 * expert), "model.action_time_mlp_in.bias": (expert,),
            "model.action_time_mlp_out.weight": (expert, expert), "model.action_time_mlp_out.bias": (expert,),
            "model.action_out_proj.weight": (padded, expert), "model.action_out_proj.bias": (padded,)}


def write_lerobot_processors(d, stats: dict, norm_map: dict) -> None:
    """LeRobot's policy_preprocessor.json / policy_postprocessor.json in ``d`` with a (un)normaliser step of
    ``norm_map`` (feature type -> mode), its statistics ``stats`` (name -> torch tensor) in the state files."""
    import json
    from safetensors.torch import save_file
    for name, step, reg in (("policy_preprocessor", 5, "normalizer_processor"),
                            ("policy_postprocessor", 0, "unnormalizer_processor")):
        state_file = f"{name}_step_{step}_{reg}.safetensors"
        save_file(stats, os.path.join(str(d), state_file))
        steps = [{"registry_name": "device_processor", "config": {}}] * step + [{
            "registry_name": reg, "config": {"eps": 1e-8, "features": {}, "norm_map": norm_map},
            "state_file": state_file}]
        with open(os.path.join(str(d), f"{name}.json"), "w", encoding="utf-8") as fh:
            json.dump({"name": name, "steps": steps}, fh)


def weight_digests(model, min_bytes: int = 1024) -> set[str]:
    """SHA-256 of each initializer of an ONNX ``model`` of at least ``min_bytes``: two graphs that share their
    weights have the same digests, so a graph set stores them once."""
    import hashlib
    from onnx import numpy_helper
    return {hashlib.sha256(numpy_helper.to_array(i).tobytes()).hexdigest()
            for i in model.graph.initializer if numpy_helper.to_array(i).nbytes >= min_bytes}
