#!/usr/bin/env python3
"""LeRobot 0.6.1's GR00T N1.7 (``lerobot.policies.groot``) as the reference the project's GR00T N1.7 is compared with.

Run it with the interpreter of ``.venv-lerobot06`` (``make lerobot06-venv``: LeRobot 0.6.1, torch 2.11 CPU,
transformers 5.5.4, diffusers 0.39 and dm-tree; see requirements-lerobot06.txt). LeRobot 0.4.4 (.venv-pi0ref) has
only GR00T N1.5, which 0.6.1 removed; this script refuses to run there. Nothing here reaches the Hugging Face Hub
(HF_HUB_OFFLINE=1): every model, tokenizer and processor file is written by make-checkpoint.

Subcommands
    check            build a minute GR00T N1.7 (make-checkpoint with MINUTE's sizes), run it twice on two frames and
                     once with Real-Time Chunking, and check what this docstring states against what LeRobot
                     computed: the same inputs give identical outputs, two noises give different actions, the
                     prompt, its tokens (tokenizer.json through the tokenizers library), the M-RoPE position ids,
                     pixel_values (the image geometry below, written out in expected_pixel_values), the state
                     normalisation, the Euler steps, the postprocessor's actions = the normalised ones decoded by
                     min-max, RTC's prefix and frozen rows (the venv's smoke test; about 12 s)
    make-checkpoint  --out DIR [--seed S --cameras base,wrist --state-dim 7 --action-dim 6 --embodiment
                     new_embodiment, sizes; --options JSON|@file]: build a small GR00T N1.7 with random weights,
                     offline, and save it as a LeRobot 0.6.1 fine-tune saves one (below)
    run              --checkpoint DIR --inputs IN.npz --out OUT.npz [--rtc] [--threads N] [--time N]: load DIR
                     with LeRobot (GrootPolicy.from_pretrained, make_groot_pre_post_processors_from_pretrained:
                     what LeRobot's policy factory calls for groot) and, for each frame of IN.npz, run the
                     preprocessor, predict_action_chunk from the given initial noise and the postprocessor; write
                     OUT.npz. --time N: then N more predict_action_chunk calls on the last frame's batch, timed
                     alone (float32, after 2 warm-up calls, nothing recorded), with the vision tower's and the
                     backbone's share from forward hooks (synflux_ros/bench/pi0.py --policy groot reads them)

The checkpoint directory (make-checkpoint)
    DIR/config.json, model.safetensors        policy.save_pretrained (GrootConfig; base_model_path = DIR/base)
    DIR/policy_preprocessor.json (+ policy_preprocessor_step_2_groot_n1_7_pack_inputs_v1.safetensors: the
        statistics observation.state.{min,max,mean,std}, action.{min,max,mean,std}, float32),
    DIR/policy_postprocessor.json (+ policy_postprocessor_step_0_groot_action_unpack_unnormalize_v2.safetensors:
        the same statistics)                 the processors' save_pretrained (make_groot_pre_post_processors with
                                              dataset_stats; the VLM step's model_name set to DIR/backbone)
    DIR/base/config.json, model.safetensors  a GR00T N1.7 base model in NVIDIA's layout: GR00TN17Config as it
        serialises (model_type Gr00tN1d7, no "type"; model_name = DIR/backbone, select_layer, max_state_dim,
        max_action_dim, action_horizon, hidden_size, input_embedding_dim, backbone_embedding_dim,
        diffusion_model_cfg, vl_self_attention_cfg, dtype float32) and its own initial weights, which the
        fine-tuned model.safetensors replaces on loading. No processor_config.json, statistics.json or
        embodiment_id.json: LeRobot then takes the default image geometry, the dataset statistics and its own
        embodiment table, as when fine-tuning a new embodiment.
    DIR/backbone/   a small Qwen3-VL in Cosmos-Reason2-2B's layout: config.json (Qwen3VLConfig), tokenizer.json
        (byte-level BPE with Qwen2's pre-tokenizer split and NFC, merges learnt from BPE_CORPUS, then the special
        tokens <|endoftext|> <|im_start|> <|im_end|> <|vision_start|> <|vision_end|> <|image_pad|> <|video_pad|>
        = ids 300..306), tokenizer_config.json (Qwen2Tokenizer, pad <|endoftext|>, the chat template
        CHAT_TEMPLATE), preprocessor_config.json (Qwen2VLImageProcessor) and video_preprocessor_config.json
        (Qwen3VLVideoProcessor), so that LeRobot's Qwen3VLProcessor loads from the directory. No weights: LeRobot
        builds the backbone from config.json (load_backbone_weights=False) and loads all weights from DIR.
    DIR/groot_dims.json   {"format": 1, "options": the sizes below, "token_ids": the special token ids}
    config.json and policy_preprocessor.json name DIR/base and DIR/backbone by absolute path, so a checkpoint
    cannot be moved (run refuses one that was). Weights are float32. The LLM's embedding table is saved only as
    _groot_model.backbone.model.lm_head.weight (tied to embed_tokens; safetensors keeps one name per shared
    tensor); run checks that every saved tensor, and embed_tokens, loaded unchanged.

The small model (make-checkpoint's defaults; the real N1.7 in brackets)
    cameras base, wrist of 240 x 320 (H x W); state_dim 7, action_dim 6; embodiment new_embodiment (id 10)
    max_state_dim 24 [132], max_action_dim 20 [132], action_horizon 16 [40] = chunk_size = n_action_steps,
    num_inference_timesteps 4 [4]
    vision: depth 4 [24], hidden 64 [1024], 4 heads [16], MLP 128 [4096], gelu_pytorch_tanh, patch 16,
        temporal_patch 2, spatial_merge 2, num_position_embeddings 2304 [2304: a 48 x 48 table bilinearly
        interpolated to the 16 x 16 patch grid], deepstack_visual_indexes [0, 1, 2] [5, 11, 17], out_hidden 96
    text: 6 layers [28] cut to select_layer 4 [16], hidden 96 [2048], 4 heads [16] x head_dim 32 [128] (q_proj
        96 -> 128: not square), 2 KV heads [8], MLP 192 [6144], rms_eps 1e-6, rope_theta 5e6, M-RoPE
        mrope_section [6, 5, 5] [24, 20, 20] interleaved, vocab 320 [151936], tied embeddings
    head: backbone_embedding_dim 96 [2048]; vl_self_attention 2 layers [4] x 3 heads [32] x 32 [64];
        DiT (AlternateVLDiT) 6 layers [32] x 4 heads [32] x 16 [48] = input_embedding_dim 64 [1536];
        hidden_size = DiT output_dim 48 [1024]; max_num_embodiments 32; position_embedding 1024 x 64
    2.5 M parameters. Every parameter is random (randomize_weights: also the adaLN and proj_out_1 modulation,
    the category-specific biases, LayerNorm/RMSNorm weights and biases).

What LeRobot computes (run), per frame (batch 1)
    Observation: prepare_observation_for_inference (uint8 HWC -> float32 / 255, CHW, batch), the task as given.
    Preprocessor: rename (identity), to_batch, groot_n1_7_pack_inputs_v1, groot_n1_7_vlm_encode_v1, device.
    * Cameras: in alphabetical order of their feature keys (observation.images.<name>; the checkpoint has no
      video_modality_keys), whatever --cameras' order; one frame each (video_horizon None). Each image goes back
      to uint8 as (clamp(x, 0, 1) * 255).to(uint8), which returns the original bytes exactly.
    * Image geometry (use_albumentations false, letter_box false; torchvision 0.26 functional on the uint8 CHW
      tensor, each resize's output uint8): resize to 256 x 256 (aspect ratio NOT kept: 240 x 320 is squashed),
      bicubic, antialias=True; centre crop of round(256 * 230 / 256) = 230 at offset floor((256 - 230) / 2) = 13
      (rows and columns 13..242); resize to 256 x 256, bicubic, antialias=True. Then Qwen2VLImageProcessor:
      smart_resize(256, 256, factor 32, min_pixels 65536, max_pixels 16777216) = 256 x 256 (its resize leaves
      the image unchanged), float32 (x - 127.5) / 127.5 (rescale 1/255 fused with mean = std = 0.5), the frame
      repeated to temporal_patch 2, patchified: grid 16 x 16 patches of 16 px, image_grid_thw [1, 16, 16].
      pixel_values rows (256 per camera, cameras concatenated in camera order) go by merge block: row
      ((bh * 8 + bw) * 2 + r) * 2 + c holds patch (2 bh + r, 2 bw + c), bh, bw in 0..7, r, c in 0..1; the 1536
      columns are (channel 3, temporal 2, y 16, x 16). 16 * 16 / 2**2 = 64 image tokens per camera. (For any
      camera size the result is the same 256 x 256 geometry.)
    * Language: the task ("" -> "Perform the task."), formalised: lower(), then only characters with
      str.isalnum(), str.isspace() or "_" kept. The chat (one user message: an image item per camera, then the
      text) rendered by the backbone's chat template with add_generation_prompt=False, e.g. for the task
      "Pick up the red cube, then place it in the bowl!" and two cameras:
          <|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>
          pick up the red cube then place it in the bowl<|im_end|>\\n
      (one line, wrapped here after the second <|vision_end|>; \\n is a newline). The processor replaces each
      <|image_pad|> by 64 of them and tokenises with tokenizer.json (padding_side left, padding to the longest of
      the batch: none for one prompt); attention_mask all ones; mm_token_type_ids 1 at image tokens. That prompt
      is 162 tokens. A real Cosmos-Reason2-2B has its own template and tokenizer: this one renders user messages
      as Qwen3-VL's does, with no system message.
    * State: 2 (x - min) / (max - min) - 1 (0 where max == min), clipped to [-1, 1], float32, zero-padded to
      max_state_dim: state [1, 1, max_state_dim]. embodiment_id = the pack step's embodiment_mapping[tag]
      (new_embodiment 10), int32 [1].
    Model (GrootPolicy.predict_action_chunk -> GR00TN17.get_action), float32:
    * Backbone: Qwen3-VL with position_ids [4, 1, L] = transformers' M-RoPE ids (rows t, h, w) with the t row
      repeated in front: a text token gets (p, p, p) and the next p + 1; a camera's 8 x 8 merged tokens start at
      its p and get (p, p + r, p + c), and the text after it continues at p + 8. Vision blocks attend within
      their image; deepstack features of vision blocks 0, 1, 2 are added at the image positions after LLM layers
      0, 1, 2; the LLM is causal (with the padding mask). backbone_features = the output of the last kept LLM
      layer, before the final norm (language_model.norm is saved but unused). image_mask = input_ids ==
      <|image_pad|>.
    * vl_embs = vl_self_attention(vlln(backbone_features)) (LayerNorm, then transformer blocks with no mask).
    * Denoising (time runs from 0 = noise to 1 = data): x_0 = the given noise [1, H, max_action_dim], dt = 1 / N
      (N = num_inference_timesteps); for k in 0..N-1: timestep t_k = int(k / N * 1000) (0, 250, 500, 750),
      velocity v_k = action_decoder(DiT([state_encoder(state), action_encoder(x_k, t_k) + position_embedding[:H]],
      vl_embs, t_k))[:, -H:], x_{k+1} = x_k + dt * v_k (* vel_strength with RTC). DiT blocks: odd ones
      self-attention over the 1 + H tokens; even ones cross-attention to vl_embs, masked to the non-image
      tokens when idx % 4 == 0 and to the image tokens when idx % 4 == 2 (each and attention_mask).
      actions_normalized = x_N[:, :chunk_size, :action_dim].
    Postprocessor (groot_action_unpack_unnormalize_v2, device): a = clip(a, -1, 1); (a + 1) / 2 * (max - min) +
    min, min where max == min (the action statistics). No LIBERO gripper transform (not libero_sim).

Initial noise and precision
    GR00T draws its initial actions once per call, torch.randn((B, H, max_action_dim)) in
    GR00TN17ActionHead.get_action_with_features; NoiseInjection substitutes the given tensor there (and fails if
    that site changes or is not hit exactly once). GrootConfig.use_bf16 (true in config.json, as a fine-tune
    saves it) makes predict_action_chunk run under torch.autocast(bfloat16): run sets it false after loading.
    model_params_fp32 (true) casts every parameter to float32; run checks that every floating parameter and
    buffer is float32.

Real-Time Chunking (run --rtc): GR00T's own, not LeRobot's guidance
    predict_action_chunk(batch, inference_delay=d, prev_chunk_left_over=P), P [n, action_dim] (normalised
    actions, e.g. the unexecuted rows of the previous actions_normalized): rows after P's last non-zero row are
    dropped (n'), at most the last H kept, zero-padded to max_action_dim. overlap = min(n', execution_horizon)
    where execution_horizon is policy.config.rtc_config.execution_horizon when set (LeRobot's RTC rollout sets
    its RTCConfig; run does when the inputs hold execution_horizon) and n' otherwise; frozen = clamp(d, 0,
    overlap). x_0[:, :overlap] = P[n' - overlap : n'] (the LAST overlap rows); vel_strength is 0 for rows
    [0, frozen), ramp[1:-1] for rows [frozen, overlap) with ramp = (1 - exp(-6 s)) / (1 - exp(-6)),
    s = linspace(0, 1, overlap - frozen + 2) (rtc_ramp_rate 6.0), 1 after. Frozen rows come out equal to P's.

IN.npz (np.load without pickle)
    observation.images.<cam>  uint8 [H, W, 3] RGB, or [F, H, W, 3] for F frames (H x W: the checkpoint's camera
                              shape, 240 x 320 by default)
    state                     float32 [state_dim] or [F, state_dim]: raw robot units
    noise                     float32 [1, action_horizon, max_action_dim] or [F, 1, action_horizon, max_action_dim]
    task                      str, 0-d unicode array (default "Pick up the red cube, then place it in the bowl!")
    --rtc also: prev_chunk_left_over float32 [n, action_dim] or [F, n, action_dim]; inference_delay int, 0-d;
                optionally execution_horizon int, 0-d

OUT.npz (every array has a leading frame axis F; L tokens, C cameras, H action_horizon, N steps)
    actions             float32 [F, chunk_size, action_dim]       the postprocessor's: robot units
    actions_normalized  float32 [F, chunk_size, action_dim]       predict_action_chunk's, before decoding
    input_ids           int64   [F, L]
    attention_mask      int64   [F, L]
    mm_token_type_ids   int64   [F, L]                            1 at image tokens
    pixel_values        float32 [F, C * 256, 1536]
    image_grid_thw      int64   [F, C, 3]                         [1, 16, 16] each
    position_ids        int64   [F, 4, L]
    backbone_features   float32 [F, L, text_hidden]               the cut LLM's pre-norm output
    image_mask          bool    [F, L]
    vl_embs             float32 [F, L, text_hidden]               after vlln and vl_self_attention
    state_normalized    float32 [F, max_state_dim]                normalised, clipped, zero-padded
    embodiment_id       int32   [F]
    timesteps           int64   [F, N]                            0, 250, 500, 750
    step_actions        float32 [F, N, H, max_action_dim]         x_k, the input of step k (x_0: the noise)
    velocity            float32 [F, N, H, max_action_dim]         v_k
    prompt              str, 0-d                                  the rendered chat before image-token expansion
    --rtc also: rtc_prefix_steps, rtc_overlap_steps, rtc_frozen_steps int64 [F]  (n', overlap, frozen)
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import time
import types
from pathlib import Path

import numpy as np

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from lerobot_pi0 import add_option_flags, gather_options, print_result  # noqa: E402
from lerobot_pi0 import io_problems  # noqa: E402
from lerobot_pi0 import randomize_weights as pi0_randomize_weights  # noqa: E402

BASE_DIR = "base"  # the GR00T N1.7 base model directory (NVIDIA's layout) inside a checkpoint
BACKBONE_DIR = "backbone"  # the Qwen3-VL backbone directory (config, tokenizer, processors) inside a checkpoint
PACK_STEP = "groot_n1_7_pack_inputs_v1"
VLM_STEP = "groot_n1_7_vlm_encode_v1"
DEFAULT_TASK = "Pick up the red cube, then place it in the bowl!"

# The Qwen3-VL special tokens, in the order the tokenizer appends them after its byte-level BPE vocabulary.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
# Qwen2's pre-tokenizer split (words with one leading non-letter, single digits, punctuation runs, newlines, spaces).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
# The chat template: Qwen3-VL's rendering of system/user/assistant messages whose content is a string or a list of
# {"type": "image"|"video"|"text"} items (an image is <|vision_start|><|image_pad|><|vision_end|>, no separators).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or 'image' in item or 'image_url' in item -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in item -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Text the byte-level BPE merges are learnt from (deterministic; any text still encodes, byte by byte at worst).
BPE_CORPUS = (
    "pick up the red cube and place it in the bowl. put the block on the plate, then open the drawer. "
    "close the door; push the button and stack the blocks. move the cup to the left of the bottle. "
    "turn on the stove, grasp the handle, pour the water into the glass. fold the towel. perform the task."
)

CHECKPOINT_DEFAULTS = {
    "seed": 0,
    "cameras": ["base", "wrist"],
    "camera_height": 240,
    "camera_width": 320,
    "state_dim": 7,
    "action_dim": 6,
    "embodiment": "new_embodiment",
    "max_state_dim": 24,
    "max_action_dim": 20,
    "action_horizon": 16,
    "chunk_size": None,  # None: action_horizon
    "num_inference_timesteps": 4,
    # the Qwen3-VL backbone
    "vision_depth": 4,
    "vision_hidden": 64,
    "vision_heads": 4,
    "vision_mlp": 128,
    "deepstack_indexes": [0, 1, 2],
    "num_position_embeddings": 2304,  # Cosmos-Reason2-2B's 48x48 learnt table, interpolated to the patch grid
    "text_layers": 6,
    "select_layer": 4,
    "text_hidden": 96,
    "text_heads": 4,
    "text_kv_heads": 2,
    "head_dim": 32,
    "text_mlp": 192,
    "mrope_section": [6, 5, 5],
    "rope_theta": 5000000.0,
    "vocab_size": 320,
    "bpe_vocab": 300,
    # the action head
    "vl_layers": 2,
    "vl_heads": 3,
    "vl_head_dim": 32,
    "dit_layers": 6,
    "dit_heads": 4,
    "dit_head_dim": 16,
    "hidden_size": 48,
}
# Fixed by the patch geometry; not options.
PATCH_SIZE = 16
TEMPORAL_PATCH_SIZE = 2
SPATIAL_MERGE_SIZE = 2
IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]
MIN_PIXELS = 65536
MAX_PIXELS = 16777216

MINUTE = {
    "cameras": ["base", "wrist"], "camera_height": 48, "camera_width": 64, "state_dim": 3, "action_dim": 2,
    "max_state_dim": 6, "max_action_dim": 5, "action_horizon": 4, "num_inference_timesteps": 2,
    "vision_depth": 2, "vision_hidden": 32, "vision_heads": 2, "vision_mlp": 64, "deepstack_indexes": [0, 1],
    "num_position_embeddings": 256, "text_layers": 3, "select_layer": 2, "text_hidden": 32, "text_heads": 2,
    "text_kv_heads": 1, "head_dim": 16, "text_mlp": 64, "mrope_section": [4, 2, 2], "vl_layers": 1, "vl_heads": 2,
    "vl_head_dim": 16, "dit_layers": 4, "dit_heads": 2, "dit_head_dim": 16, "hidden_size": 24,
}


# --------------------------------------------------------------------------------------------------------------
# LeRobot


def require_lerobot_06() -> None:
    import lerobot

    major, minor = (int(p) for p in lerobot.__version__.split(".")[:2])
    if (major, minor) < (0, 6):
        raise SystemExit(f"LeRobot {lerobot.__version__} has no GR00T N1.7 (0.6 and later do): run this script with "
                         f"the interpreter of .venv-lerobot06")


def groot_modules():
    require_lerobot_06()
    from lerobot.policies.groot import configuration_groot, groot_n1_7, modeling_groot, processor_groot

    return types.SimpleNamespace(config=configuration_groot, model=groot_n1_7, policy=modeling_groot,
                                 processor=processor_groot)


# --------------------------------------------------------------------------------------------------------------
# Options


def checkpoint_options(args, defaults: dict = CHECKPOINT_DEFAULTS) -> dict:
    o = gather_options(args, defaults)
    for key in ("deepstack_indexes", "mrope_section"):
        if isinstance(o[key], str):
            o[key] = [int(v) for v in o[key].split(",") if v]
    if o["chunk_size"] is None:
        o["chunk_size"] = o["action_horizon"]
    problems = []
    problems += io_problems(o)
    # GrootConfig silently replaces these N1.5-era values by N1.7's (132, 132, 40)
    if o["max_state_dim"] == 64 or o["max_action_dim"] == 32 or o["chunk_size"] == 50:
        problems.append("max_state_dim 64, max_action_dim 32 and chunk_size 50 are rewritten by GrootConfig")
    if not 0 < o["chunk_size"] <= o["action_horizon"]:
        problems.append("chunk_size must be in 1..action_horizon")
    if o["select_layer"] < len(o["deepstack_indexes"]) or o["select_layer"] > o["text_layers"]:
        problems.append("select_layer must be in len(deepstack_indexes)..text_layers")
    if any(not 0 <= i < o["vision_depth"] for i in o["deepstack_indexes"]):
        problems.append("deepstack_indexes must be vision blocks")
    if sum(o["mrope_section"]) * 2 != o["head_dim"] or len(o["mrope_section"]) != 3:
        problems.append("mrope_section must be three numbers summing to head_dim / 2")
    if o["text_heads"] % o["text_kv_heads"] or o["vision_hidden"] % o["vision_heads"]:
        problems.append("heads must divide evenly")
    if o["vl_heads"] * o["vl_head_dim"] != o["text_hidden"]:
        problems.append("vl_heads * vl_head_dim must equal text_hidden (the VL self-attention runs at its width)")
    if o["dit_layers"] < 2 or o["dit_layers"] % 2:
        problems.append("dit_layers must be even (cross- and self-attention blocks alternate)")
    if int(round(o["num_position_embeddings"] ** 0.5)) ** 2 != o["num_position_embeddings"]:
        problems.append("num_position_embeddings must be a square")
    if o["bpe_vocab"] < 257 or o["vocab_size"] < o["bpe_vocab"] + len(SPECIAL_TOKENS):
        problems.append("bpe_vocab must be over 256 and vocab_size at least bpe_vocab + 7 special tokens")
    if problems:
        raise SystemExit("make-checkpoint: " + "; ".join(problems))
    return o


# --------------------------------------------------------------------------------------------------------------
# make-checkpoint: the backbone directory (a small Qwen3-VL in Cosmos-Reason2-2B's layout)


def make_tokenizer(o: dict):
    """A byte-level BPE (Qwen2's pre-tokenizer split, NFC) with merges learnt from BPE_CORPUS and the Qwen3-VL
    special tokens appended after them."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=o["bpe_vocab"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator([BPE_CORPUS] * 4, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def write_backbone(directory: Path, o: dict) -> dict:
    """Write the backbone directory: config.json (Qwen3VLConfig), tokenizer.json + tokenizer_config.json (with the
    chat template), preprocessor_config.json and video_preprocessor_config.json; returns the special token ids."""
    from transformers import Qwen3VLConfig

    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(o)
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 4096,
        "padding_side": "left",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for t, i in ids.items()},
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    image_config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD, "do_convert_rgb": True,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE, "merge_size": SPATIAL_MERGE_SIZE,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(image_config, indent=2) + "\n")
    video_config = {**image_config, "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2, "min_frames": 4,
                    "max_frames": 768, "do_sample_frames": True,
                    "size": {"shortest_edge": 4096, "longest_edge": 25165824}}
    del video_config["image_processor_type"]
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video_config, indent=2) + "\n")

    config = Qwen3VLConfig(
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        text_config={
            "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"], "head_dim": o["head_dim"], "hidden_act": "silu",
            "hidden_size": o["text_hidden"], "initializer_range": 0.02, "intermediate_size": o["text_mlp"],
            "max_position_embeddings": 262144, "model_type": "qwen3_vl_text",
            "num_attention_heads": o["text_heads"], "num_hidden_layers": o["text_layers"],
            "num_key_value_heads": o["text_kv_heads"], "rms_norm_eps": 1e-6,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": list(o["mrope_section"]),
                             "rope_type": "default"},
            "rope_theta": o["rope_theta"], "tie_word_embeddings": True, "use_cache": True,
            "vocab_size": o["vocab_size"], "dtype": "float32",
        },
        vision_config={
            "deepstack_visual_indexes": list(o["deepstack_indexes"]), "depth": o["vision_depth"],
            "hidden_act": "gelu_pytorch_tanh", "hidden_size": o["vision_hidden"], "in_channels": 3,
            "initializer_range": 0.02, "intermediate_size": o["vision_mlp"], "model_type": "qwen3_vl",
            "num_heads": o["vision_heads"], "num_position_embeddings": o["num_position_embeddings"],
            "out_hidden_size": o["text_hidden"], "patch_size": PATCH_SIZE, "spatial_merge_size": SPATIAL_MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
    )
    config.save_pretrained(directory)
    return ids


# --------------------------------------------------------------------------------------------------------------
# make-checkpoint: the base model directory and the fine-tuned checkpoint


def base_config_fields(o: dict, backbone: Path) -> dict:
    """The GR00TN17Config fields a small N1.7 differs in from NVIDIA's (the rest keep GR00T_N1_7_DEFAULTS)."""
    return {
        "model_name": str(backbone),
        "select_layer": o["select_layer"],
        "backbone_embedding_dim": o["text_hidden"],
        "max_state_dim": o["max_state_dim"],
        "max_action_dim": o["max_action_dim"],
        "action_horizon": o["action_horizon"],
        "hidden_size": o["hidden_size"],
        "input_embedding_dim": o["dit_heads"] * o["dit_head_dim"],
        "num_inference_timesteps": o["num_inference_timesteps"],
        "diffusion_model_cfg": {
            "positional_embeddings": None, "num_layers": o["dit_layers"], "num_attention_heads": o["dit_heads"],
            "attention_head_dim": o["dit_head_dim"], "norm_type": "ada_norm", "dropout": 0.2, "final_dropout": True,
            "output_dim": o["hidden_size"], "interleave_self_attention": True,
        },
        "vl_self_attention_cfg": {
            "positional_embeddings": None, "num_layers": o["vl_layers"], "num_attention_heads": o["vl_heads"],
            "attention_head_dim": o["vl_head_dim"], "dropout": 0.2, "final_dropout": True,
        },
    }


def weight_value(module, module_name: str, param_name: str, param, noise):
    """The random value of one parameter given its standard normal draw (see randomize_weights)."""
    from torch import nn

    kind = type(module).__name__
    if kind == "CategorySpecificLinear":  # W [embodiments, in, out], b [embodiments, out]
        return noise / param.shape[1] ** 0.5 if param_name == "W" else 0.1 * noise
    if isinstance(module, nn.LayerNorm) or kind.endswith("RMSNorm"):  # Qwen3's RMSNorm scales by w, not 1 + w
        return 1.0 + 0.3 * noise if param_name == "weight" else 0.1 * noise
    if param_name == "bias":
        return 0.1 * noise
    if isinstance(module, nn.Embedding):
        return 0.5 * noise if "pos" in module_name else noise
    return noise / (param[0].numel() ** 0.5)  # Linear and Conv3d weights: [out, in, ...]


def randomize_weights(model, seed: int) -> None:
    """Overwrite every parameter with seeded random values that keep activations of order one.

    Each tensor draws from its own generator seeded by the seed and the parameter's name, so the values depend on
    neither construction order nor library versions. Everything GR00T initialises to zero or one (the
    category-specific biases, LayerNorm and RMSNorm weights and biases, every Linear bias) or leaves at its
    defaults (the DiT's adaLN and proj_out_1 modulation, the timestep MLP) gets a random value too, so every weight
    changes the actions. The draws are lerobot_pi0's (a tied lm_head drawn once), GR00T's rule above.
    """
    pi0_randomize_weights(model, seed, rule=weight_value)


def make_stats(rng: np.random.Generator, dim: int) -> dict:
    """Min-max statistics of one feature (with a mean and std inside, which the GR00T steps save but do not use)."""
    center = rng.normal(0.0, 0.5, dim)
    half = rng.uniform(0.3, 2.0, dim)
    return {"min": (center - half).astype(np.float32), "max": (center + half).astype(np.float32),
            "mean": (center + 0.1 * half * rng.normal(size=dim)).astype(np.float32),
            "std": (0.4 * half).astype(np.float32)}


def policy_config(o: dict, base: Path):
    from lerobot.configs.types import FeatureType, PolicyFeature

    g = groot_modules()
    inputs = {f"observation.images.{cam}": PolicyFeature(type=FeatureType.VISUAL,
                                                          shape=(3, o["camera_height"], o["camera_width"]))
              for cam in o["cameras"]}
    inputs["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(o["state_dim"],))
    return g.config.GrootConfig(
        base_model_path=str(base),
        embodiment_tag=o["embodiment"],
        chunk_size=o["chunk_size"],
        n_action_steps=o["chunk_size"],
        max_state_dim=o["max_state_dim"],
        max_action_dim=o["max_action_dim"],
        input_features=inputs,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(o["action_dim"],))},
        device="cpu",
    )


def make_checkpoint(args) -> dict:
    """Write DIR/backbone, DIR/base (a GR00T N1.7 base model with its own initial weights) and, in DIR, the
    fine-tuned policy (randomised) saved by LeRobot with its pre/post processors."""
    import torch

    started = time.perf_counter()
    o = checkpoint_options(args)
    g = groot_modules()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    backbone, base = out / BACKBONE_DIR, out / BASE_DIR
    ids = write_backbone(backbone, o)

    torch.manual_seed(o["seed"])
    base_model = g.model.GR00TN17(g.model.GR00TN17Config(**base_config_fields(o, backbone)),
                                  load_backbone_weights=False)
    base_model.save_pretrained(base)
    del base_model

    config = policy_config(o, base)
    policy = g.policy.GrootPolicy(config)
    randomize_weights(policy, o["seed"])
    rng = np.random.default_rng(o["seed"])
    stats = {"observation.state": make_stats(rng, o["state_dim"]), "action": make_stats(rng, o["action_dim"])}
    preprocessor, postprocessor = g.processor.make_groot_pre_post_processors(config, dataset_stats=stats)
    vlm = [s for s in preprocessor.steps if isinstance(s, g.processor.GrootN17VLMEncodeStep)]
    if len(vlm) != 1:
        raise RuntimeError("the GR00T preprocessor has no VLM encode step")
    vlm[0].model_name = str(backbone)  # LeRobot writes nvidia/Cosmos-Reason2-2B, whose processor is on the Hub

    policy.save_pretrained(out)
    preprocessor.save_pretrained(out)
    postprocessor.save_pretrained(out)
    (out / "groot_dims.json").write_text(json.dumps({"format": 1, "options": o, "token_ids": ids}, indent=2) + "\n")
    return {"checkpoint": str(out), "files": sorted(p.name for p in out.iterdir()),
            "seconds": round(time.perf_counter() - started, 2)}


# --------------------------------------------------------------------------------------------------------------
# run


def load_reference(checkpoint: Path):
    """The policy and its processors, loaded by LeRobot (GrootPolicy.from_pretrained and LeRobot's GR00T processor
    loader) from the checkpoint directory, in float32 with bf16 autocast off."""
    import torch

    g = groot_modules()
    from lerobot.configs.policies import PreTrainedConfig

    checkpoint = checkpoint.resolve()
    config = PreTrainedConfig.from_pretrained(checkpoint)
    if config.type != "groot":
        raise SystemExit(f"{checkpoint} holds a {config.type!r} policy, not groot")
    base = Path(config.base_model_path)
    if base != checkpoint / BASE_DIR or not (base / "config.json").exists():
        raise SystemExit(f"{checkpoint}: base_model_path is {config.base_model_path}, not {checkpoint / BASE_DIR} "
                         f"(a checkpoint of make-checkpoint cannot be moved: its config names absolute paths)")
    policy = g.policy.GrootPolicy.from_pretrained(checkpoint)
    policy.eval()
    policy.config.use_bf16 = False  # predict_action_chunk's torch.autocast(bfloat16) is off: float32 throughout
    wrong = {n: p.dtype for n, p in policy.named_parameters() if p.dtype != torch.float32}
    wrong.update({n: b.dtype for n, b in policy.named_buffers() if b.is_floating_point() and b.dtype != torch.float32})
    if wrong:
        raise RuntimeError(f"not float32 after loading: {dict(list(wrong.items())[:5])}")
    verify_weights(policy, checkpoint)
    preprocessor, postprocessor = g.processor.make_groot_pre_post_processors_from_pretrained(policy.config, checkpoint)
    torch.set_grad_enabled(False)
    return policy, preprocessor, postprocessor


def verify_weights(policy, checkpoint: Path) -> None:
    """Fail unless every tensor of model.safetensors is in the loaded policy unchanged. The LLM's embedding table is
    saved only as ``…backbone.model.lm_head.weight`` (tied to embed_tokens; safetensors keeps one name of a shared
    tensor), so that one must also be what the loaded embed_tokens holds."""
    import torch
    from safetensors.torch import load_file

    saved = load_file(checkpoint / "model.safetensors")
    state = policy.state_dict()
    wrong = [k for k, v in saved.items() if k not in state or not torch.equal(state[k], v.to(state[k].dtype))]
    embed = policy._groot_model.backbone.language_model.embed_tokens.weight
    head = "_groot_model.backbone.model.lm_head.weight"
    if head in saved and not torch.equal(embed, saved[head]):
        wrong.append("embed_tokens (saved as lm_head)")
    if wrong:
        raise RuntimeError(f"{len(wrong)} saved tensors did not load, e.g. {wrong[:3]}")


def read_inputs(path: Path, config, rtc: bool) -> dict:
    data = np.load(path, allow_pickle=False)
    cams = [k for k in config.image_features]
    frames = None
    images = {}
    for key in cams:
        if key not in data.files:
            raise ValueError(f"{path} lacks {key}")
        img = data[key]
        if img.dtype != np.uint8 or img.ndim not in (3, 4) or img.shape[-1] != 3:
            raise ValueError(f"{key}: expected uint8 [frames,] H x W x 3, got {img.dtype} {img.shape}")
        img = img[None] if img.ndim == 3 else img
        frames = img.shape[0] if frames is None else frames
        if img.shape[0] != frames or tuple(img.shape[1:3]) != tuple(config.image_features[key].shape[1:]):
            raise ValueError(f"{key}: {img.shape} does not match {frames} frames of "
                             f"{tuple(config.image_features[key].shape[1:])}")
        images[key] = img
    known = set(cams) | {"state", "task", "noise"} | ({"prev_chunk_left_over", "inference_delay",
                                                       "execution_horizon"} if rtc else set())
    extra = sorted(set(data.files) - known)
    if extra:
        raise ValueError(f"{path}: unexpected arrays {extra}")
    state_dim = config.input_features["observation.state"].shape[0]
    state = data["state"].astype(np.float32).reshape(frames, state_dim)
    task = str(data["task"]) if "task" in data.files else DEFAULT_TASK
    noise = data["noise"].astype(np.float32)
    noise = noise.reshape((frames,) + noise.shape[-3:]) if noise.ndim >= 3 else noise[None, None]
    result = {"images": images, "state": state, "task": task, "noise": noise, "frames": frames}
    if rtc:
        for key in ("prev_chunk_left_over", "inference_delay"):
            if key not in data.files:
                raise ValueError(f"--rtc: {path} lacks {key}")
        prev = data["prev_chunk_left_over"].astype(np.float32)
        result["prev"] = np.broadcast_to(prev, (frames,) + prev.shape) if prev.ndim == 2 else prev
        result["inference_delay"] = int(data["inference_delay"])
        if "execution_horizon" in data.files:
            result["execution_horizon"] = int(data["execution_horizon"])
        if result["prev"].shape[0] != frames:
            raise ValueError("prev_chunk_left_over: one [steps, dims] leftover, or one per frame")
    return result


class NoiseInjection:
    """Make GR00T's action head start denoising from given noise.

    GR00TN17ActionHead.get_action_with_features draws its initial actions with ``torch.randn(size=(B, horizon,
    max_action_dim), dtype=..., device=...)`` through the name ``torch`` of lerobot.policies.groot.groot_n1_7. While
    active, that module's ``torch`` is a stand-in whose randn returns the given tensor (and fails for any other
    size); every other attribute is torch's. The sampling site is checked in the source first, and exactly one draw
    must happen per call, so a change of where LeRobot samples fails loudly instead of silently using fresh noise.
    """

    SITE = "actions = torch.randn("

    def __init__(self, module):
        import torch

        source = inspect.getsource(module.GR00TN17ActionHead.get_action_with_features)
        if source.count(self.SITE) != 1 or source.count("randn") != 1:
            raise RuntimeError("GR00T no longer samples its initial noise with one `actions = torch.randn(` in "
                               "GR00TN17ActionHead.get_action_with_features: update NoiseInjection")
        self.module = module
        self.torch = torch
        self.noise = None
        self.draws = 0

    @contextlib.contextmanager
    def supplying(self, noise):
        real = self.torch
        injection = self

        class _Torch(types.ModuleType):
            def __getattr__(self, name):
                return getattr(real, name)

        def randn(*size, **kwargs):
            shape = tuple(kwargs.pop("size", size[0] if len(size) == 1 and not isinstance(size[0], int) else size))
            if shape != tuple(injection.noise.shape):
                raise RuntimeError(f"GR00T drew noise of shape {shape}, the given noise is "
                                   f"{tuple(injection.noise.shape)}")
            injection.draws += 1
            return injection.noise.clone().to(dtype=kwargs.get("dtype") or real.float32,
                                              device=kwargs.get("device") or "cpu")

        stand_in = _Torch("torch")
        stand_in.randn = randn
        self.noise, self.draws = noise, 0
        self.module.torch = stand_in
        try:
            yield
        finally:
            self.module.torch = real
        if self.draws != 1:
            raise RuntimeError(f"GR00T drew its initial noise {self.draws} times, expected once")


class Recorder:
    """Forward hooks that keep the intermediates of one predict_action_chunk call (float32 copies)."""

    def __init__(self, policy):
        model = policy._groot_model
        self.model = model
        self.data: dict = {}
        head = model.action_head
        self.handles = [
            model.backbone.register_forward_hook(self._backbone),
            head.vl_self_attention.register_forward_hook(self._vl),
            head.action_encoder.register_forward_hook(self._encoder),
            head.action_decoder.register_forward_hook(self._decoder),
        ]
        backbone = model.backbone
        self._ensure = backbone._ensure_legacy_qwen3_position_ids

        def capture_position_ids(model_input):
            self._ensure(model_input)
            self.data["position_ids"] = model_input["position_ids"].clone()

        backbone._ensure_legacy_qwen3_position_ids = capture_position_ids
        self.backbone = backbone
        get_action = model.get_action

        def capture_options(inputs, options=None):
            self.data["rtc_options"] = dict(options) if options else None
            return get_action(inputs, options=options) if options is not None else get_action(inputs)

        model.get_action = capture_options

    def start(self):
        self.data = {"velocity": [], "step_actions": [], "timesteps": []}

    def close(self):
        """Stop recording: the hooks removed, the backbone's and the model's own methods back."""
        for handle in self.handles:
            handle.remove()
        vars(self.backbone).pop("_ensure_legacy_qwen3_position_ids", None)
        vars(self.model).pop("get_action", None)

    def _backbone(self, _module, _inputs, output):
        # cloned now: the action head replaces backbone_features in this same BatchFeature
        self.data["backbone_features"] = output["backbone_features"].detach().clone()
        self.data["image_mask"] = output["image_mask"].clone()
        self.data["backbone_attention_mask"] = output["backbone_attention_mask"].clone()

    def _vl(self, _module, _inputs, output):
        self.data["vl_embs"] = output.detach().clone()

    def _encoder(self, _module, inputs, _output):
        actions, timesteps = inputs[0], inputs[1]
        self.data["step_actions"].append(actions.detach().clone())
        self.data["timesteps"].append(timesteps.detach().clone())

    def _decoder(self, module, _inputs, output):
        horizon = self.horizon
        self.data["velocity"].append(output[:, -horizon:].detach().clone())


def run(args) -> dict:
    import torch

    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = groot_modules()
    from lerobot.policies.utils import prepare_observation_for_inference

    checkpoint = Path(args.checkpoint).resolve()
    policy, preprocessor, postprocessor = load_reference(checkpoint)
    loaded = time.perf_counter()
    inputs = read_inputs(Path(args.inputs), policy.config, args.rtc)
    head = policy._groot_model.action_head
    horizon, max_action_dim = head.action_horizon, head.action_dim
    injection = NoiseInjection(g.model)
    recorder = Recorder(policy)
    recorder.horizon = horizon
    if args.rtc and "execution_horizon" in inputs:
        # what LeRobot's RTC rollout does (policy.config.rtc_config = the rollout's RTCConfig); GR00T reads only
        # its execution_horizon
        from lerobot.policies.rtc.configuration_rtc import RTCConfig

        policy.config.rtc_config = RTCConfig(execution_horizon=inputs["execution_horizon"])

    rows = []
    for f in range(inputs["frames"]):
        noise = torch.from_numpy(inputs["noise"][f])
        if tuple(noise.shape) != (1, horizon, max_action_dim):
            raise ValueError(f"noise must be [1, {horizon}, {max_action_dim}], got {list(noise.shape)}")
        observation = {k: img[f].copy() for k, img in inputs["images"].items()}
        observation["observation.state"] = inputs["state"][f].copy()
        observation = prepare_observation_for_inference(observation, torch.device("cpu"), task=inputs["task"],
                                                        robot_type="")
        batch = preprocessor(observation)
        kwargs = {}
        if args.rtc:
            kwargs = {"inference_delay": inputs["inference_delay"],
                      "prev_chunk_left_over": torch.from_numpy(np.array(inputs["prev"][f]))}
        recorder.start()
        with injection.supplying(noise):
            normalized = policy.predict_action_chunk(batch, **kwargs)
        actions = postprocessor(normalized.clone())
        rows.append(frame_outputs(batch, normalized, actions, recorder.data, args.rtc))
    finished = time.perf_counter()
    timing = None
    if getattr(args, "time", 0):
        recorder.close()
        timing = time_chunks(policy, batch, noise, injection, args.time)

    out = {key: np.stack([r[key] for r in rows]) for key in rows[0]}
    out["prompt"] = np.array(preprocessor_prompt(preprocessor, inputs["task"], len(inputs["images"])))
    if args.out:
        np.savez(args.out, **out)
    result = {"out": str(args.out) if args.out else None, "frames": inputs["frames"],
              "actions_shape": list(out["actions"].shape), "prompt": str(out["prompt"]),
              "load_seconds": round(loaded - started, 2), "seconds_per_frame": round((finished - loaded)
                                                                                     / inputs["frames"], 3)}
    if args.rtc:
        result["rtc"] = {k: out[f"rtc_{k}_steps"].tolist() for k in ("prefix", "overlap", "frozen")}
    if timing:
        result.update(timing)
    return result


def time_chunks(policy, batch: dict, noise, injection: NoiseInjection, calls: int, warmup: int = 2) -> dict:
    """``calls`` timed calls of predict_action_chunk on the last frame's preprocessed batch and noise (float32,
    after ``warmup`` untimed ones), the intermediates no longer recorded; the median, min and max in ms, and the
    median of its stages from forward hooks: vision (the Qwen3-VL vision tower), backbone (the rest of the
    Qwen3-VL backbone: the LLM up to select_layer) and head (the rest of the call: vl_self_attention and the
    DiT's denoising steps)."""
    import statistics

    import torch

    backbone = policy._groot_model.backbone
    spans: dict = {}
    started: dict = {}

    def before(name):
        def hook(_module, _inputs):
            started[name] = time.perf_counter()
        return hook

    def after(name):
        def hook(_module, _inputs, _output):
            spans[name] = spans.get(name, 0.0) + (time.perf_counter() - started[name]) * 1e3
        return hook

    handles = []
    for name, module in (("vision", backbone.visual), ("backbone", backbone)):
        handles += [module.register_forward_pre_hook(before(name)), module.register_forward_hook(after(name))]
    totals, stages = [], {"vision": [], "backbone": [], "head": []}
    try:
        for k in range(warmup + calls):
            spans.clear()
            with injection.supplying(noise):
                start = time.perf_counter()
                policy.predict_action_chunk(batch)
                total = (time.perf_counter() - start) * 1e3
            if k < warmup:
                continue
            totals.append(total)
            stages["vision"].append(spans["vision"])
            stages["backbone"].append(spans["backbone"] - spans["vision"])
            stages["head"].append(total - spans["backbone"])
    finally:
        for handle in handles:
            handle.remove()
    return {"calls": calls, "threads": torch.get_num_threads(), "median_ms": statistics.median(totals),
            "min_ms": min(totals), "max_ms": max(totals),
            **{f"{name}_median_ms": statistics.median(v) for name, v in stages.items()}}


def frame_outputs(batch: dict, normalized, actions, rec: dict, rtc: bool) -> dict:
    """One frame's row of run's .npz (the batch dimension dropped)."""
    row = {
        "actions": actions[0].numpy().astype(np.float32),
        "actions_normalized": normalized[0].numpy().astype(np.float32),
        "input_ids": batch["input_ids"][0].numpy().astype(np.int64),
        "attention_mask": batch["attention_mask"][0].numpy().astype(np.int64),
        "mm_token_type_ids": batch["mm_token_type_ids"][0].numpy().astype(np.int64),
        "pixel_values": batch["pixel_values"].numpy().astype(np.float32),
        "image_grid_thw": batch["image_grid_thw"].numpy().astype(np.int64),
        "position_ids": rec["position_ids"][:, 0].numpy().astype(np.int64),
        "backbone_features": rec["backbone_features"][0].numpy().astype(np.float32),
        "image_mask": rec["image_mask"][0].numpy(),
        "vl_embs": rec["vl_embs"][0].numpy().astype(np.float32),
        "state_normalized": batch["state"][0, 0].numpy().astype(np.float32),
        "embodiment_id": np.int32(batch["embodiment_id"][0].item()),
        "timesteps": np.array([int(t[0]) for t in rec["timesteps"]], dtype=np.int64),
        "step_actions": np.stack([a[0].numpy() for a in rec["step_actions"]]).astype(np.float32),
        "velocity": np.stack([v[0].numpy() for v in rec["velocity"]]).astype(np.float32),
    }
    if rtc:
        opts = rec.get("rtc_options")
        row["rtc_overlap_steps"] = np.int64(opts["rtc_overlap_steps"] if opts else 0)
        row["rtc_frozen_steps"] = np.int64(opts["rtc_frozen_steps"] if opts else 0)
        row["rtc_prefix_steps"] = np.int64(opts["action_horizon"] if opts else 0)
    return row


def preprocessor_prompt(preprocessor, task: str, cameras: int) -> str:
    """The chat text the VLM encode step renders for ``task`` (before image-token expansion)."""
    from lerobot.policies.groot.processor_groot import GrootN17PackInputsStep, GrootN17VLMEncodeStep
    from lerobot.policies.groot.utils import prepare_n1_7_language_batch

    pack = next(s for s in preprocessor.steps if isinstance(s, GrootN17PackInputsStep))
    vlm = next(s for s in preprocessor.steps if isinstance(s, GrootN17VLMEncodeStep))
    language = prepare_n1_7_language_batch(task, 1, formalize_language=pack.formalize_language)[0]
    content = [{"type": "image"} for _ in range(cameras * (pack.video_horizon or 1))]
    return vlm.proc.apply_chat_template([{"role": "user", "content": [*content, {"type": "text", "text": language}]}],
                                        tokenize=False, add_generation_prompt=False)


# --------------------------------------------------------------------------------------------------------------
# check


def expected_pixel_values(image: np.ndarray, crop: int = 230, target: int = 256) -> np.ndarray:
    """The docstring's image geometry, written out: one camera's uint8 H x W x 3 frame to its pixel_values rows."""
    import torch
    import torchvision.transforms.v2.functional as tvf
    from torchvision.transforms import InterpolationMode

    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)
    x = tvf.resize(x, [target, target], interpolation=InterpolationMode.BICUBIC, antialias=True)
    size = int(round(target * crop / target))
    top = (target - size) // 2
    x = x[:, top:top + size, top:top + size]
    x = tvf.resize(x, [target, target], interpolation=InterpolationMode.BICUBIC, antialias=True)
    x = (x.float() - 127.5) / 127.5
    g, m, p, t = target // PATCH_SIZE, SPATIAL_MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE
    x = x[None].expand(t, -1, -1, -1)  # [t, c, h, w]: the still image repeated over the temporal patch
    x = x.reshape(t, 3, g // m, m, p, g // m, m, p).permute(2, 5, 3, 6, 1, 0, 4, 7)
    return x.reshape(g * g, 3 * t * p * p).numpy()


def expected_prompt(task: str, cameras: int) -> str:
    text = "".join(ch for ch in (task or "Perform the task.").lower() if ch.isalnum() or ch.isspace() or ch == "_")
    images = "<|vision_start|><|image_pad|><|vision_end|>" * cameras
    return f"<|im_start|>user\n{images}{text}<|im_end|>\n"


def expected_position_ids(input_ids: np.ndarray, image_id: int, grids: np.ndarray) -> np.ndarray:
    """The docstring's M-RoPE position ids of one prompt: [4, L] (row 0 repeats the temporal row 1)."""
    rows, p, i = [], 0, 0
    images = iter(grids)
    while i < len(input_ids):
        if input_ids[i] != image_id:
            rows.append((p, p, p))
            p, i = p + 1, i + 1
            continue
        t, gh, gw = (int(v) for v in next(images))
        gh, gw = gh // SPATIAL_MERGE_SIZE, gw // SPATIAL_MERGE_SIZE
        rows += [(p + k, p + r, p + c) for k in range(t) for r in range(gh) for c in range(gw)]
        p, i = p + max(t, gh, gw), i + t * gh * gw
    thw = np.array(rows, dtype=np.int64).T
    return np.concatenate([thw[:1], thw])


def check(args) -> dict:
    """Build a minute GR00T N1.7, run it, and check what the docstring says against what LeRobot computed: the
    prompt and its tokens, the image geometry, the state normalisation, the Euler steps, the decoding of the
    actions, Real-Time Chunking's prefix, that the result depends on the given noise and on nothing else."""
    import tempfile

    import lerobot
    import torch
    import transformers
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    started = time.perf_counter()
    problems = []

    def expect(ok, what):
        if not ok:
            problems.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ck = tmp / "ck"
        make_checkpoint(argparse.Namespace(out=ck, options=json.dumps(MINUTE)))
        o = checkpoint_options(argparse.Namespace(options=json.dumps(MINUTE)))
        stats = load_file(ck / "policy_preprocessor_step_2_groot_n1_7_pack_inputs_v1.safetensors")
        rng = np.random.default_rng(7)
        h, a, d = o["action_horizon"], o["action_dim"], o["max_action_dim"]
        smin, smax = stats["observation.state.min"], stats["observation.state.max"]
        images = {f"observation.images.{c}": rng.integers(0, 256, (2, o["camera_height"], o["camera_width"], 3),
                                                           dtype=np.uint8) for c in o["cameras"]}
        state = (smin + (smax - smin) * rng.uniform(-0.2, 1.2, (2, o["state_dim"]))).astype(np.float32)
        noise = rng.normal(size=(2, 1, h, d)).astype(np.float32)
        np.savez(tmp / "in.npz", **images, state=state, noise=noise, task=np.array(DEFAULT_TASK))
        prev = rng.uniform(-0.9, 0.9, (h - 1, a)).astype(np.float32)
        np.savez(tmp / "rtc.npz", **images, state=state, noise=noise, task=np.array(DEFAULT_TASK),
                 prev_chunk_left_over=prev, inference_delay=np.int64(1))

        def run_once(name, inputs="in.npz", rtc=False):
            run(argparse.Namespace(checkpoint=ck, inputs=tmp / inputs, out=tmp / name, rtc=rtc, threads=0))
            return dict(np.load(tmp / name, allow_pickle=False))

        first, second = run_once("a.npz"), run_once("b.npz")
        expect(first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first),
               "two runs on the same inputs differ")
        expect(not np.allclose(first["actions"][0], first["actions"][1]), "two noises gave the same actions")
        expect(np.array_equal(first["input_ids"][0], first["input_ids"][1]), "the prompt tokens changed with noise")

        # the actions: the postprocessor's are the normalised ones decoded by min-max with clipping
        amin, amax = stats["action.min"], stats["action.max"]
        norm = first["actions_normalized"]
        decoded = np.where(amax > amin, (np.clip(norm, -1, 1) + 1) / 2 * (amax - amin) + amin, amin)
        expect(np.allclose(first["actions"], decoded, rtol=0, atol=1e-5), "actions != min-max decoding")
        # the state: min-max to [-1, 1], clipped, zero-padded to max_state_dim
        own = np.clip(2 * (state - smin) / (smax - smin) - 1, -1, 1)
        expect(np.allclose(first["state_normalized"][:, :o["state_dim"]], own, atol=1e-6)
               and not first["state_normalized"][:, o["state_dim"]:].any(), "state normalisation differs")
        # the Euler steps: x_{k+1} = x_k + v_k / N from the given noise; the chunk is the first chunk_size rows
        steps = o["num_inference_timesteps"]
        x = first["step_actions"]
        expect(np.array_equal(x[:, 0], noise[:, 0]), "denoising did not start from the given noise")
        expect(np.allclose(x[:, 1:], x[:, :-1] + first["velocity"][:, :-1] / steps, atol=1e-6), "Euler steps")
        final = x[:, -1] + first["velocity"][:, -1] / steps
        expect(np.allclose(norm, final[:, :o["chunk_size"], :a], atol=1e-6), "normalised actions != last step")
        expect(first["timesteps"][0].tolist() == [int(k / steps * 1000) for k in range(steps)], "time schedule")
        expect(int(first["embodiment_id"][0]) == 10, "embodiment id")
        # the prompt, its tokens (tokenizer.json by the tokenizers library) and the image rows
        cams = len(o["cameras"])
        prompt = expected_prompt(DEFAULT_TASK, cams)
        expect(str(first["prompt"]) == prompt, f"prompt {str(first['prompt'])!r}")
        tokens = (256 // PATCH_SIZE // SPATIAL_MERGE_SIZE) ** 2
        expanded = prompt.replace("<|image_pad|>", "<|image_pad|>" * tokens)
        ids = Tokenizer.from_file(str(ck / BACKBONE_DIR / "tokenizer.json")).encode(expanded).ids
        expect(first["input_ids"][0].tolist() == ids, "input_ids != tokenizer.json's encoding of the prompt")
        expect(first["attention_mask"].all(), "attention mask")
        image_id = json.loads((ck / "groot_dims.json").read_text())["token_ids"]["<|image_pad|>"]
        expect(np.array_equal(first["image_mask"][0], first["input_ids"][0] == image_id), "image mask")
        expect(first["image_grid_thw"][0].tolist() == [[1, 16, 16]] * cams, "image_grid_thw")
        expect(np.array_equal(first["position_ids"][0], expected_position_ids(first["input_ids"][0], image_id,
                                                                            first["image_grid_thw"][0])),
               "position ids")
        rows = np.concatenate([expected_pixel_values(images[f"observation.images.{c}"][0]) for c in o["cameras"]])
        expect(np.allclose(first["pixel_values"][0], rows, rtol=0, atol=1e-6), "pixel_values != image geometry")

        # Real-Time Chunking: the last overlap rows of the leftover replace the first rows of the noise, the
        # first inference_delay of them are frozen
        rtc = run_once("rtc.npz", "rtc.npz", rtc=True)
        overlap, frozen = int(rtc["rtc_overlap_steps"][0]), int(rtc["rtc_frozen_steps"][0])
        expect((overlap, frozen) == (h - 1, 1), f"RTC overlap/frozen {overlap}/{frozen}")
        start = rtc["step_actions"][:, 0]
        expect(np.array_equal(start[:, :overlap, :a], np.broadcast_to(prev[-overlap:], (2, overlap, a)))
               and not start[:, :overlap, a:].any() and np.array_equal(start[:, overlap:], noise[:, 0, overlap:]),
               "RTC initial actions")
        expect(np.array_equal(rtc["actions_normalized"][:, :frozen], np.broadcast_to(prev[-overlap:][:frozen],
                                                                                     (2, frozen, a))),
               "RTC frozen rows moved")
        expect(not np.allclose(rtc["actions_normalized"], norm), "RTC changed nothing")

    if problems:
        raise SystemExit("GR00T reference check failed: " + "; ".join(problems))
    return {"groot_reference": "ok", "lerobot": lerobot.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "seconds": round(time.perf_counter() - started, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="smoke test of the environment and of the facts the docstring states")

    mk = sub.add_parser("make-checkpoint", help="save a small random GR00T N1.7 as a LeRobot 0.6.1 checkpoint")
    mk.add_argument("--out", required=True, help="checkpoint directory to write")
    mk.add_argument("--options", help="JSON object of the options below (underscored names), or @file.json")
    flags = {key: (str if isinstance(v, (str, list)) else float if isinstance(v, float) else int)
             for key, v in CHECKPOINT_DEFAULTS.items()}
    notes = {"cameras": "comma-separated; features observation.images.<name>",
             "embodiment": "embodiment_tag (new_embodiment = id 10)", "chunk_size": "default action_horizon",
             "deepstack_indexes": "comma-separated vision blocks", "mrope_section": "comma-separated, sums to "
                                                                                   "head_dim / 2"}
    shown = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in CHECKPOINT_DEFAULTS.items()}
    add_option_flags(mk, shown, flags, notes)

    rn = sub.add_parser("run", help="compute action chunks with LeRobot's GR00T N1.7")
    rn.add_argument("--checkpoint", required=True, help="checkpoint directory of make-checkpoint")
    rn.add_argument("--inputs", required=True, help=".npz of inputs (see the module docstring)")
    rn.add_argument("--out", help=".npz to write (see the module docstring)")
    rn.add_argument("--rtc", action="store_true", help="GR00T's native real-time chunking: the inputs also hold "
                                                       "prev_chunk_left_over and inference_delay")
    rn.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    rn.add_argument("--time", type=int, default=0, metavar="N",
                    help="also time N calls of predict_action_chunk on the last frame (after 2 untimed ones), "
                         "with its stages (vision, backbone, head) from forward hooks")

    args = parser.parse_args(argv)
    print_result({"check": check, "make-checkpoint": make_checkpoint, "run": run}[args.command], args)


if __name__ == "__main__":
    main()
