"""Real-Time Chunking on π0 (onnxruntime, fp32) equals LeRobot's RTC on the same checkpoint, for the checkpoints of
LeRobot 0.4.4 and of LeRobot 0.6.1, each against the release that saved it.

The small random π0 of test_pi0_lerobot.py is saved by LeRobot and imported by ``synflux-build --from-hf``; the
runtime runs in this process. A previous chunk is computed for an earlier frame, and the part of it not executed
yet (normalised model actions, as LeRobot's action queue keeps them: fewer steps than the horizon and only the
robot's dimensions, or all of the model's) guides the chunk of the next frame. The reference runs
``PI0Policy.predict_action_chunk`` with RTC enabled in the policy's config (schedule, execution horizon,
max_guidance_weight) and ``prev_chunk_left_over`` / ``inference_delay``, on the same images, instruction, state
and noise; normalised and un-normalised actions must agree to 1e-4 for every schedule and several delays.

The ``vjp`` guidance (``action_expert_vjp_<d>``, exported from the same weights) is compared with the same
LeRobot step taking torch autograd's vector-Jacobian product through LeRobot's own π0 (its denoiser's input
marked as requiring gradients before the velocity is evaluated), to the same tolerance.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
pytest.importorskip("onnxruntime")

from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.model.heads.rtc import RTCGuidance  # noqa: E402
from synflux_ros.model.tokenizer import load_tokenizer  # noqa: E402
from synflux_ros.runtimes.vla import VLARuntime  # noqa: E402

from checkpoints import write_tokenizer  # noqa: E402
from pi0_reference import base_config, lerobot_params, random_frame, reference  # noqa: E402

INSTRUCTION = "pick up the red block"
TOLERANCE = 1e-4
PREV_SEQ, SEQ = 4, 5  # frame numbers (they seed the noise) of the previous chunk and of the guided one

pytestmark = pytest.mark.reference

# (schedule, inference delay, execution horizon, max guidance weight, leftover)
CASES = [(schedule, delay, 6, 10.0, "robot_dims") for schedule in ("zeros", "ones", "linear", "exp")
         for delay in (2, 4)]
CASES += [("linear", 3, 10, 5.0, "model_dims"), ("exp", 1, 5, 2.5, "model_dims")]
VJP_CASES = [("linear", 2, 6, 10.0, "robot_dims"), ("linear", 4, 6, 10.0, "robot_dims"),
             ("exp", 3, 8, 10.0, "model_dims"), ("ones", 2, 6, 5.0, "robot_dims"), ("zeros", 3, 6, 10.0, "robot_dims")]
LEFTOVERS = {"robot_dims": 3, "model_dims": 2}  # steps of the previous chunk executed before the new frame




@pytest.fixture(scope="module", params=lerobot_params())
def checkpoint(request, tmp_path_factory):
    """The small random π0, saved by one LeRobot release, with a tokenizer beside it: (release, directory)."""
    tmp = tmp_path_factory.mktemp(f"pi0_rtc_{request.param}")
    ckpt = tmp / "checkpoint"
    assert reference("make-checkpoint", "--out", str(ckpt), "--cameras", "base", "--seed", "3",
                     "--state-norm", "MEAN_STD", "--action-norm", "MEAN_STD", lerobot=request.param)
    write_tokenizer(str(ckpt), first_specials=("<pad>", "<eos>", "<bos>"))
    return request.param, ckpt


def compare(checkpoint: tuple[str, Path], tmp: Path, cases: list, guidance: str) -> dict:
    """Our chunks (plain and guided, with ``guidance``) and LeRobot's for the same inputs, from one reference
    run; the vjp graph set also gives the lerobot flavour's chunks (``ours_lerobot``)."""
    lerobot, ckpt = checkpoint
    out = tmp / "graphs"
    execution = {"mode": "rtc", "rtc": {"guidance": "vjp"}} if guidance == "vjp" else None
    assert build_tool.main(["--config", base_config(tmp / "base.yaml", execution), "--out", str(out),
                            "--from-hf", str(ckpt), "--backend", "onnxruntime"]) == 0
    cfg = load_config(str(out / "config.yaml"))
    assert cfg.action.output_dim == 6 and cfg.action.action_norm is not None
    tok = load_tokenizer(cfg, shipped=str(out / "tokenizer.json"))
    ids = [tok.special("<bos>")] + tok.encode(INSTRUCTION + "\n")
    dims = cfg.action.output_dim

    image, state, padded_state = random_frame(11, cfg.action.state_dim)
    rt = VLARuntime(cfg)
    try:
        rt.set_instruction(INSTRUCTION)
        # the previous chunk, from the frame before (another state and noise): its normalised actions
        previous = rt.infer(image, seq=PREV_SEQ, state=padded_state - 0.2).raw_actions
        leftovers = {"robot_dims": previous[LEFTOVERS["robot_dims"]:, :dims],
                     "model_dims": previous[LEFTOVERS["model_dims"]:]}
        plain = rt.infer(image, seq=SEQ, state=padded_state)
        ours = {"lerobot": [], guidance: []}
        for flavour in ours:
            for schedule, delay, horizon, weight, left in cases:
                rtc = RTCGuidance(leftovers[left], inference_delay=delay, execution_horizon=horizon,
                                  schedule=schedule, max_guidance_weight=weight, flavour=flavour)
                frame = rt.infer(image, seq=SEQ, state=padded_state, rtc=rtc)
                ours[flavour].append((frame.actions, frame.raw_actions[:, :dims]))
    finally:
        rt.close()

    noise = np.random.default_rng(cfg.action.seed + SEQ).standard_normal(
        (cfg.action.action_horizon, cfg.action.action_dim)).astype(np.float32)
    inputs, case_file = tmp / "inputs.npz", tmp / "rtc.json"
    np.savez(inputs, lang_tokens=np.array(ids, np.int64), state=state, noise=noise,
             **{"observation.images.base": image}, **{f"prev_{k}": v for k, v in leftovers.items()})
    case_file.write_text(json.dumps([
        {"prev_chunk": f"prev_{left}", "inference_delay": delay, "execution_horizon": horizon,
         "schedule": schedule.upper(), "max_guidance_weight": weight, "guidance": guidance}
        for schedule, delay, horizon, weight, left in cases]))
    result = tmp / "lerobot.npz"
    reference("run", "--checkpoint", str(ckpt), "--inputs", str(inputs), "--rtc", str(case_file), "--out",
              str(result), lerobot=lerobot)
    want = np.load(result)
    weights = json.loads((out / "manifest.json").read_text())["weights"]["bytes"]
    return dict(weights_bytes=weights, plain=(plain.actions, plain.raw_actions[:, :dims]), ours=ours[guidance], ours_lerobot=ours["lerobot"],
                want_plain=(want["actions"], want["actions_normalized"]),
                want=[(want[f"actions_rtc_{i}"], want[f"actions_normalized_rtc_{i}"]) for i in range(len(cases))])


@pytest.fixture(scope="module")
def compared(checkpoint, tmp_path_factory):
    return compare(checkpoint, tmp_path_factory.mktemp("lerobot_flavour"), CASES, "lerobot")


@pytest.fixture(scope="module")
def compared_vjp(checkpoint, tmp_path_factory):
    return compare(checkpoint, tmp_path_factory.mktemp("vjp_flavour"), VJP_CASES, "vjp")


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> float:
    assert got.shape == want.shape, what
    err = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    assert err <= TOLERANCE * max(1.0, scale), f"{what}: max difference {err} (values up to {scale})"
    return err


def test_plain_chunk_equals_lerobot(compared):
    for got, want, what in zip(compared["plain"], compared["want_plain"], ("actions", "normalised actions")):
        assert_close(got, want, what)


@pytest.mark.parametrize("case", range(len(CASES)), ids=["{}-d{}-h{}-w{}-{}".format(*c) for c in CASES])
def test_rtc_chunk_equals_lerobot(compared, case):
    (got, got_norm), (want, want_norm) = compared["ours"][case], compared["want"][case]
    err = assert_close(got, want, "actions")
    err_norm = assert_close(got_norm, want_norm, "normalised actions")
    print(f"{CASES[case]}: max |synflux - LeRobot| = {err:.2e} (normalised {err_norm:.2e})")
    # the comparison has teeth: the guidance moves both chunks away from the plain one
    assert np.abs(want_norm - compared["want_plain"][1]).max() > 100 * TOLERANCE
    assert np.abs(got_norm - compared["plain"][1]).max() > 100 * TOLERANCE


@pytest.mark.parametrize("case", range(len(VJP_CASES)), ids=["{}-d{}-h{}-w{}-{}".format(*c) for c in VJP_CASES])
def test_rtc_vjp_chunk_equals_lerobot_with_autograd_through_the_model(compared_vjp, case):
    c = compared_vjp
    (got, got_norm), (want, want_norm) = c["ours"][case], c["want"][case]
    err = assert_close(got, want, "actions")
    err_norm = assert_close(got_norm, want_norm, "normalised actions")
    lerobot_flavour = c["ours_lerobot"][case][1]
    print(f"vjp {VJP_CASES[case]}: max |synflux - LeRobot| = {err:.2e} (normalised {err_norm:.2e}); "
          f"the Jacobian moves the chunk by {np.abs(got_norm - lerobot_flavour).max():.2e}")
    # the comparison has teeth: the guidance moves the chunk, and the Jacobian term moves it further than
    # the tolerance away from the lerobot flavour's
    assert np.abs(got_norm - c["plain"][1]).max() > 100 * TOLERANCE
    assert np.abs(want_norm - lerobot_flavour).max() > 10 * TOLERANCE


def test_vjp_graphs_store_no_weights_of_their_own(compared, compared_vjp):
    assert compared_vjp["weights_bytes"] <= compared["weights_bytes"] + 4096
