"""Greedy image chat through vlm_node (onnxruntime, fp32) equals transformers' Qwen3-VL generate on the same
weights and the same preprocessed pixels: one and two images in a turn, and a conversation with an image in
turn 1 and text in turn 2 (reused cache against transformers' recomputation). A tiny random Qwen3-VL (vision
tower with two DeepStack layers, interleaved M-RoPE) is built from its config and saved as a checkpoint.

The reference runs transformers as its processor does: the chat template's ``<|image_pad|>`` expanded to the
image's merged tokens, ``pixel_values`` as flattened 2x(16x16) patches in 2x2 merge-block order,
``image_grid_thw`` and ``mm_token_type_ids`` (without which transformers falls back to 1-D positions).
"""
from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

import rclpy  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.core.config import PreprocessSpec
from synflux_ros.model.image import Preprocessor  # noqa: E402
from synflux_ros.tools import harness as testing  # noqa: E402

from checkpoints import write_tokenizer  # noqa: E402
from ros_clients import ChatClient, ok  # noqa: E402

pytestmark = pytest.mark.reference

NEW = 32
SIDE, PATCH, TEMPORAL, MERGE = 64, 16, 2, 2
GRID = SIDE // PATCH  # patches per side; (GRID / MERGE)^2 = 4 image tokens
TEMPLATE = (  # Qwen3-VL's layout: an image item is <|vision_start|><|image_pad|><|vision_end|>
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def hf_config(tok):
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")}
    return transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
                           temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, out_hidden_size=64,
                           num_position_embeddings=36, deepstack_visual_indexes=[0, 1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=len(tok) - 1,
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory, ros_env):
    """(transformers model, its tokenizer, eos ids, preprocessing, a chat client of vlm_node on the same weights)."""
    ckpt = tmp_path_factory.mktemp("qwen3vl_ckpt")
    write_tokenizer(str(ckpt))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    torch.manual_seed(2)
    hf = transformers.Qwen3VLForConditionalGeneration(hf_config(tok)).eval()
    with torch.no_grad():  # livelier than the default init: greedy picks are not near-ties, images matter
        gen = torch.Generator().manual_seed(3)
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(ckpt)
    base = tmp_path_factory.mktemp("cfg") / "qwen3vl.yaml"
    base.write_text(yaml.safe_dump({
        "name": "qwen3vl-tiny", "mode": "vlm",
        "vision": {"architecture": "qwen3_vl", "resolution": [SIDE, SIDE], "tile_size": [SIDE, SIDE],
                   "tokens_per_tile": 4, "patch_size": PATCH, "mean": [0.5] * 3, "std": [0.5] * 3},
        "llm": {"num_layers": 3, "hidden_dim": 64, "num_heads": 4, "vocab_size": len(tok),
                "prefill_buckets": [32, 128], "decode_buckets": [256, 512], "max_seq_len": 512},
        "text": {"max_new_tokens": NEW}, "session": {"max_sessions": 3, "max_images_per_turn": 2}}))
    out = tmp_path_factory.mktemp("qwen3vl_graphs")
    assert build_tool.main(["--config", str(base), "--out", str(out), "--from-hf", str(ckpt)]) == 0
    cfg = load_config(str(out / "config.yaml"))
    assert cfg.llm.mrope_section == (4, 2, 2) and cfg.vision.deepstack_layers == (0, 1)
    v = cfg.vision
    pre = Preprocessor(PreprocessSpec(resolution=tuple(v.resolution), tile_size=tuple(v.tile_size), resize=v.resize,
                                      pad_value=v.pad_value, mean=tuple(v.mean), std=tuple(v.std),
                                      interpolation=v.interpolation))
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    node = rclpy.create_node(f"image_parity_client_{uuid.uuid4().hex[:8]}")
    with testing.NodeProcess("vlm_node", {"config": str(out / "config.yaml")}, env=ros_env,
                             remaps={"__ns": "/image_parity"}) as proc:
        yield hf, tok, eos, pre, ChatClient(node, "/image_parity")
        assert proc.alive(), proc.output()[-3000:]
    node.destroy_node()


def picture(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)


def image_msg(rgb: np.ndarray) -> Image:
    h, w, _ = rgb.shape
    return Image(height=h, width=w, encoding="rgb8", step=3 * w, data=rgb.tobytes())


def patches(tile: np.ndarray) -> torch.Tensor:
    """A preprocessed [1, 3, H, W] tile as transformers' Qwen2-VL image processor lays it out: rows of
    3 x 2 x 16 x 16 (the still frame twice over time), 2x2 merge blocks contiguous."""
    c, g, m = 3, GRID, MERGE
    x = tile[0].reshape(c, g // m, m, PATCH, g // m, m, PATCH).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], TEMPORAL, PATCH, PATCH))
    return torch.from_numpy(np.ascontiguousarray(x).reshape(g * g, c * TEMPORAL * PATCH * PATCH))


def reference(hf, tok, eos, pre, messages, images) -> tuple[str, int]:
    """transformers' reply: the template's ids with each image pad expanded, then generate."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    pad = hf.config.image_token_id
    per_image = (GRID // MERGE) ** 2
    ids = [t for i in ids for t in ([pad] * per_image if i == pad else [i])]
    assert ids.count(pad) == per_image * len(images)
    inp = torch.tensor([ids])
    kw = {}
    if images:
        kw = dict(pixel_values=torch.cat([patches(pre(im)) for im in images]),
                  image_grid_thw=torch.tensor([[1, GRID, GRID]] * len(images)),
                  mm_token_type_ids=(inp == pad).long())
    hf.model.rope_deltas = None  # generate caches it on the model
    with torch.no_grad():
        out = hf.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=NEW,
                          eos_token_id=eos, pad_token_id=eos[0], **kw)
    new = out[0, inp.shape[1]:].tolist()
    return tok.decode([t for t in new if t not in eos], skip_special_tokens=True), len(new)


def user(prompt: str, n_images: int) -> dict:
    if not n_images:
        return {"role": "user", "content": prompt}
    return {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": prompt}]}


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_replies_about_images_equal_transformers_generate(served, n_images):
    hf, tok, eos, pre, chat = served
    pictures = [picture(10 + i) for i in range(n_images)]
    got = ok(chat.chat(f"images-{n_images}", "What is on the table?", images=[image_msg(p) for p in pictures],
                       temperature=0.0))
    want, n = reference(hf, tok, eos, pre, [user("What is on the table?", n_images)], pictures)
    assert (got.reply, got.generated_tokens) == (want, n)
    assert n == NEW  # the whole reply is compared (no early end of sequence)
    # the images are not ignored: another picture gets another reply (from both engines)
    other = ok(chat.chat(f"other-{n_images}", "What is on the table?", temperature=0.0,
                         images=[image_msg(picture(20 + i)) for i in range(n_images)]))
    assert other.reply != got.reply
    assert other.reply == reference(hf, tok, eos, pre, [user("What is on the table?", n_images)],
                                    [picture(20 + i) for i in range(n_images)])[0]


def test_an_image_then_text_turn_reuses_the_cache_and_equals_recomputation(served):
    hf, tok, eos, pre, chat = served
    pic = picture(30)
    first = ok(chat.chat("two-turns", "Describe the scene.", images=[image_msg(pic)], temperature=0.0))
    messages = [user("Describe the scene.", 1)]
    assert (first.reply, first.generated_tokens) == reference(hf, tok, eos, pre, messages, [pic])
    messages.append({"role": "assistant", "content": first.reply})
    second = ok(chat.chat("two-turns", "Where is the cup?", temperature=0.0))
    messages.append(user("Where is the cup?", 0))
    # transformers prefills the whole conversation again (the image's positions and DeepStack included)
    assert (second.reply, second.generated_tokens) == reference(hf, tok, eos, pre, messages, [pic])
    assert second.cached_tokens > 4 and second.cached_tokens + second.prompt_tokens > first.prompt_tokens
