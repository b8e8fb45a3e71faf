"""SmolVLA through synflux-build -> vla_node (onnxruntime, fp32) equals LeRobot's SmolVLA on the same checkpoint,
for the checkpoints of LeRobot 0.4.4 and of LeRobot 0.6.1, each against the release that saved it.

A small SmolVLA with random weights (every norm and bias too) is built and saved by LeRobot itself
(``test/reference/lerobot_smolvla.py make-checkpoint``, in ``.venv-pi0ref`` or ``.venv-lerobot06``): two cameras, a
SmolVLM vision tower
whose patches are pixel-shuffled, a truncated Llama, an action expert whose odd layers cross-attend to the
prefix, MEAN_STD normalisation of state and actions. ``synflux-build --from-hf`` imports it; vla_node serves it
over DDS with both cameras and a joint state per frame. For each published chunk the reference computes
``SmolVLAPolicy.predict_action_chunk`` on the same images, the same prompt tokens, the same state and the same
noise (vla_node's: ``default_rng(action.seed + frame_seq)``); the actions must agree to 1e-4. The prompt ids are
compared with the ones LeRobot's own preprocessor writes for the instruction (with a tokenizer whose post-processor
adds a BOS, as ``tokenizer(text)`` applies it). Real-Time Chunking (both
guidances) is compared the same way, in this process.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
pytest.importorskip("onnxruntime")

from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.core.contract import select_bucket  # noqa: E402
from synflux_ros.model.tokenizer import load_tokenizer  # noqa: E402
from synflux_ros.runtimes.vla import VLARuntime  # noqa: E402
from synflux_ros.tools.harness import chunk_for_frame  # noqa: E402

from checkpoints import write_tokenizer  # noqa: E402
from pi0_reference import check_rtc_against_lerobot, publish_cameras, serve_cameras  # noqa: E402
from smolvla_reference import lerobot_params, reference  # noqa: E402

INSTRUCTION = "pick up the red block"
TOLERANCE = 1e-4
CAMERAS = ("top", "wrist")
JOINTS = [f"joint_{i}" for i in range(7)]
SIDE = 48  # the checkpoint's image size: 6x6 patches of 8, shuffled by 2 into 3x3 tokens per camera

pytestmark = pytest.mark.reference


def base_config(path, execution: dict | None = None) -> str:
    """The config the import starts from: the joint names (not in a LeRobot checkpoint), the SmolVLM dims the
    shapes do not fix (heads, epsilons: the reference's smolvla_dims.json), the executor."""
    raw = {
        "name": "smolvla-small", "mode": "vla",
        "vision": {"resolution": [SIDE, SIDE], "tile_size": [SIDE, SIDE], "tokens_per_tile": 9, "patch_size": 8,
                   "hidden_dim": 32, "num_layers": 2, "num_heads": 4, "layer_norm_eps": 1e-6},
        "llm": {"num_layers": 4, "hidden_dim": 48, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                "vocab_size": 512, "rms_norm_eps": 1e-5, "prefill_buckets": [32], "decode_buckets": [128],
                "max_seq_len": 128, "architecture": "llama"},
        "action": {"head_type": "flow_matching", "action_dim": 32, "action_horizon": 10, "state_dim": 32,
                   "state_joints": JOINTS, "state_max_age": 0.1, "seed": 7},
        "executor": {"backend": "onnxruntime"},
    }
    if execution:
        raw["execution"] = execution
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture(scope="module", params=lerobot_params())
def imported(request, tmp_path_factory):
    """The SmolVLA saved by one LeRobot release and its graph set."""
    lerobot = request.param
    tmp = tmp_path_factory.mktemp(f"smolvla_{lerobot}")
    ckpt = tmp / "checkpoint"
    made = reference("make-checkpoint", "--out", str(ckpt), "--cameras", ",".join(CAMERAS), "--seed", "5",
                     "--state-dim", str(len(JOINTS)), "--action-dim", "6", "--image-size", str(SIDE), lerobot=lerobot)
    assert made["image_tokens"] == 9
    write_bos_tokenizer(ckpt)
    out = tmp / "graphs"
    assert build_tool.main(["--config", base_config(tmp / "base.yaml"), "--out", str(out), "--from-hf", str(ckpt),
                            "--backend", "onnxruntime"]) == 0
    cfg = load_config(str(out / "config.yaml"))
    act = cfg.action
    assert (act.state_input, act.expert_attention, act.action_attention) == ("prefix", "cross_attn", "causal")
    assert cfg.vision.cameras == CAMERAS and cfg.vision.token_merge == "pixel_shuffle"
    assert act.state_norm.mode == "mean_std" and act.output_dim == 6 and act.expert_hidden_dim == 36
    # prompts of up to 32 tokens take a smaller prefill bucket: 2 x 9 image tokens, the prompt, the state row
    assert cfg.llm.prefill_buckets == (51, 67) and cfg.llm.max_seq_len == 72
    return dict(tmp=tmp, ckpt=ckpt, out=out, cfg=cfg, tok=load_tokenizer(cfg, shipped=str(out / "tokenizer.json")),
                lerobot=lerobot)


def write_bos_tokenizer(ckpt) -> None:
    """The tests' tokenizer.json with a post-processor that puts a BOS first (transformers' ``tokenizer(text)``
    adds it, ``add_special_tokens`` being on by default), so that the prompt's special tokens are compared too."""
    from tokenizers import Tokenizer, processors
    write_tokenizer(str(ckpt))
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>",
                                                                                                   bos)])
    tok.save(str(ckpt / "tokenizer.json"))


def prompt_ids(s: dict) -> list[int]:
    """The prompt ids vla_node builds: the instruction and a newline with the tokenizer's special tokens (here a
    BOS first), cut to tokenizer_max_length."""
    ids = s["tok"].encode_prompt(INSTRUCTION + "\n")
    assert ids[0] == s["tok"].special("<|endoftext|>") and ids[1:] == s["tok"].encode(INSTRUCTION + "\n")
    return ids


def lerobot(s: dict, name: str, images, state, ids, noise, rtc: list | None = None, prev=None):
    """LeRobot's SmolVLA on these inputs: (its JSON result, the arrays it wrote)."""
    inputs = s["tmp"] / f"{name}.npz"
    extra = {"prev_chunk": prev} if prev is not None else {}
    np.savez(inputs, lang_tokens=np.array(ids, np.int64), state=np.asarray(state, np.float32),
             noise=noise.astype(np.float32), **{f"observation.images.{c}": im for c, im in zip(CAMERAS, images)},
             **extra)
    out = s["tmp"] / f"{name}_out.npz"
    args = ["run", "--checkpoint", str(s["ckpt"]), "--inputs", str(inputs), "--out", str(out)]
    if rtc:
        cases = s["tmp"] / f"{name}_rtc.json"
        cases.write_text(json.dumps(rtc))
        args += ["--rtc", str(cases)]
    return reference(*args, lerobot=s["lerobot"]), np.load(out)


def test_the_prompt_is_lerobots(imported):
    """The ids vla_node embeds are those LeRobot's own preprocessor (newline step, tokenizer step) writes."""
    s = imported
    got = reference("tokens", "--checkpoint", str(s["ckpt"]), "--tokenizer", str(s["out"] / "tokenizer.json"),
                    "--task", INSTRUCTION, lerobot=s["lerobot"])
    assert got["ids"] == prompt_ids(s) and got["prompt"] == INSTRUCTION + "\n"
    # LeRobot pads SmolVLA's prompt to the longest in the batch (none here); the node prefills its 27 rows in the
    # bucket of 51, where the largest holds 67: the actions below are computed at the smaller size
    assert 2 * 9 + len(got["ids"]) + 1 == 27 and select_bucket(s["cfg"].llm.prefill_buckets, 27) == 51
    assert s["cfg"].tokenizer.prompt_special_tokens


@pytest.fixture(scope="module")
def served(imported, ros_env):
    yield from serve_cameras(imported, ros_env, "/smolvla", CAMERAS, INSTRUCTION)


def publish_frame(s: dict, stamp: int, images, state) -> None:
    publish_cameras(s, stamp, images, state, JOINTS)


def frame_inputs(seed: int):
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8) for _ in CAMERAS]
    return images, rng.uniform(-1.5, 1.5, len(JOINTS)).astype(np.float32)


@pytest.mark.parametrize("case", [0, 1])
def test_actions_equal_lerobot(served, case):
    s, cfg = served, served["cfg"]
    images, state = frame_inputs(300 + case)
    stamp = (400 + 10 * case) * 10**9
    c = chunk_for_frame(s["node"], s["chunks"], lambda t: publish_frame(s, t, images, state), stamp, 60.0, wait=2.0)
    got = np.array(c.actions, np.float32).reshape(c.horizon, c.action_dim)
    noise = np.random.default_rng(cfg.action.seed + c.frame_seq).standard_normal(
        (cfg.action.action_horizon, cfg.action.action_dim)).astype(np.float32)
    ids = prompt_ids(s)
    _, want = lerobot(s, f"case{case}", images, state, ids, noise)
    assert want["actions"].shape == got.shape == (cfg.action.action_horizon, 6)
    err, scale = float(np.abs(got - want["actions"]).max()), float(np.abs(want["actions"]).max())
    print(f"{s['lerobot']}, case {case}: max |synflux - LeRobot| = {err:.2e} (actions up to {scale:.2f}); "
          f"{len(ids)} prompt tokens")
    assert err <= TOLERANCE * max(1.0, scale), f"max difference {err} (actions up to {scale})"
    # the comparison has teeth: another state, another wrist image each give other actions
    _, other = lerobot(s, f"case{case}_state", images, state + 0.5, ids, noise)
    assert np.abs(other["actions"] - want["actions"]).max() > 100 * TOLERANCE
    _, other = lerobot(s, f"case{case}_wrist", [images[0], images[1][::-1].copy()], state, ids, noise)
    assert np.abs(other["actions"] - want["actions"]).max() > 100 * TOLERANCE


@pytest.mark.parametrize("guidance", ["lerobot", "vjp"])
def test_real_time_chunking_equals_lerobots(imported, guidance):
    """RTC on SmolVLA: a previous chunk's leftover steers the next chunk as LeRobot's RTC does, for two schedules
    and delays, with the lerobot guidance and with the vjp guidance (its action_expert_vjp graphs, through the
    cross-attention layers and the causal action tokens) against LeRobot's step with torch autograd; the guided
    chunks differ from the plain one."""
    s = imported
    images, state = frame_inputs(21)

    def run_lerobot(noise, cases, leftover):
        return lerobot(s, f"rtc-{guidance}", images, state, prompt_ids(s), noise, rtc=cases, prev=leftover)[1]
    check_rtc_against_lerobot(s, guidance, base_config, INSTRUCTION, images, state, run_lerobot, TOLERANCE)


def test_self_attn_mode_equals_lerobot(imported):
    """LeRobot's attention_mode self_attn (every expert layer attends to the prefix and the action tokens, no
    cross-attention layer) imports as expert_attention joint and equals LeRobot's, in this process."""
    tmp = imported["tmp"] / "self_attn"
    ckpt = tmp / "checkpoint"
    reference("make-checkpoint", "--out", str(ckpt), "--cameras", ",".join(CAMERAS), "--seed", "6",
              "--state-dim", str(len(JOINTS)), "--action-dim", "6", "--image-size", str(SIDE),
              "--attention-mode", "self_attn", lerobot=imported["lerobot"])
    write_bos_tokenizer(ckpt)
    out = tmp / "graphs"
    assert build_tool.main(["--config", base_config(imported["tmp"] / "base-sa.yaml"), "--out", str(out),
                            "--from-hf", str(ckpt), "--backend", "onnxruntime"]) == 0
    cfg = load_config(str(out / "config.yaml"))
    assert cfg.action.expert_attention == "joint" and cfg.action.action_attention == "causal"
    images, state = frame_inputs(33)
    rt = VLARuntime(cfg)
    try:
        rt.set_instruction(INSTRUCTION)
        got = rt.infer(images, seq=2, state=np.r_[state, np.zeros(cfg.action.state_dim - len(state), np.float32)])
    finally:
        rt.close()
    noise = np.random.default_rng(cfg.action.seed + 2).standard_normal(
        (cfg.action.action_horizon, cfg.action.action_dim)).astype(np.float32)
    _, want = lerobot(dict(imported, tmp=tmp, ckpt=ckpt), "sa", images, state, prompt_ids(imported), noise)
    np.testing.assert_allclose(got.actions, want["actions"], atol=TOLERANCE * max(1.0, np.abs(want["actions"]).max()))
