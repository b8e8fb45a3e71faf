"""A VLA as openpi's policy (synflux_ros.serve.policy) on the mock executor: observation keys onto cameras, state
and prompt, the checks that refuse a request naming the key, and the chunk equal to the runtime's."""
from __future__ import annotations

import numpy as np
import pytest

from synflux_ros.core.config import ConfigError, load_config
from synflux_ros.serve.policy import RequestError, VLAPolicy
from synflux_ros.runtimes.vla import VLARuntime
from synflux_ros.tools import harness as testing

ALOHA_CAMERAS = ["cam_high", "cam_left_wrist"]


def aloha_config():
    """Two cameras, 14-value state, ALOHA's nested keys (openpi's aloha example: images/<camera>, CHW)."""
    cfg = load_config(testing.config_path("vla_demo_orin.yaml"))
    return cfg.with_overrides(
        vision={"cameras": ALOHA_CAMERAS, "resolution": [224, 224]},
        action={"state_dim": 16, "state_joints": [f"j{i}" for i in range(14)]},
        serve={"images": {c: ["images", c] for c in ALOHA_CAMERAS}, "state": ["state"]})


@pytest.fixture(scope="module")
def aloha():
    policy = VLAPolicy(aloha_config())
    yield policy
    policy.close()


def aloha_obs(seed=0, **over):
    rng = np.random.default_rng(seed)
    obs = {"images": {c: rng.integers(0, 256, (3, 224, 224), dtype=np.uint8) for c in ALOHA_CAMERAS},
           "state": rng.uniform(-1, 1, 14), "prompt": "fold the towel"}
    obs.update(over)
    return obs


def test_aloha_keys_chw_images_and_state_reach_the_runtime(aloha):
    obs = aloha_obs()
    out = aloha.infer(obs, seq=3)
    assert out["actions"].shape == (16, 7) and out["actions"].dtype == np.float32
    assert set(out["policy_timing"]) >= {"infer_ms", "vision_ms", "backbone_ms", "head_ms"}
    runtime = VLARuntime(aloha_config())
    try:
        runtime.set_instruction("fold the towel")
        state = np.zeros(16, np.float32)
        state[:14] = obs["state"]
        images = [obs["images"][c].transpose(1, 2, 0) for c in ALOHA_CAMERAS]
        np.testing.assert_array_equal(out["actions"], runtime.infer(images, seq=3, state=state).actions)
    finally:
        runtime.close()
    assert aloha.metadata["cameras"] == {c: f"[images, {c}]" for c in ALOHA_CAMERAS}
    assert aloha.metadata["state_dim"] == 14


def test_the_prompt_is_kept_until_a_request_changes_it(aloha):
    aloha.infer(aloha_obs(prompt="stack the cups"), seq=0)
    assert aloha.runtime.instruction == "stack the cups"
    obs = aloha_obs()
    del obs["prompt"]
    aloha.infer(obs, seq=1)
    assert aloha.runtime.instruction == "stack the cups"


@pytest.mark.parametrize("change,needle", [
    (lambda o: o["images"].pop("cam_high"), "camera 'cam_high': the observation has no image at 'images/cam_high' "
                                            "(no 'cam_high' in images)"),
    (lambda o: o.update(images=np.zeros(3)), "no 'cam_high' in images"),
    (lambda o: o["images"].update(cam_high=np.zeros((224, 224), np.uint8)), "expected a uint8 image HxWx3 or 3xHxW"),
    (lambda o: o["images"].update(cam_high=np.zeros((224, 224, 4), np.uint8)), "expected 3 colour channels"),
    (lambda o: o["images"].update(cam_high="jpeg"), "got a str"),
    (lambda o: o.update(state=np.zeros(13)), "state: state hold 13 values, the model takes 14"),
    (lambda o: o.update(state=np.zeros((2, 7))), "expected a number or a 1-D array"),
    (lambda o: o.update(state="1,2,3"), "expected a number or a 1-D array"),
    (lambda o: o.update(state=np.full(14, np.inf)), "holds NaN or Inf"),
    (lambda o: o.pop("state"), "state: the observation has no value at 'state'"),
    (lambda o: o.update(prompt=""), "prompt: instruction is empty"),
    (lambda o: o.update(rtc=[1, 2]), "rtc: expected a map with prev_chunk"),
    (lambda o: o.update(rtc={"prev_chunk": np.zeros((3, 7)), "inference_delay": True}), "rtc inference_delay"),
    (lambda o: o.update(rtc={"prev_chunk": np.full((3, 7), np.nan), "inference_delay": 1}), "holds NaN or Inf"),
    (lambda o: o.update(rtc={"prev_chunk": np.zeros((3, 7)), "inference_delay": 1, "execution_horizon": 1.5}),
     "rtc execution_horizon"),
    (lambda o: o.update(rtc={"prev_chunk": np.zeros((3, 7)), "inference_delay": 10**9}),
     "rtc inference_delay: 1000000000 is out of range (0 to the model's horizon, 16 steps)"),
    (lambda o: o.update(rtc={"prev_chunk": np.zeros((3, 7)), "inference_delay": 1, "execution_horizon": 17}),
     "rtc execution_horizon: 17 is out of range"),
    (lambda o: o["images"].update(cam_high=np.zeros((0, 0, 3), np.uint8)), "a zero-size image (0x0)"),
    (lambda o: o["images"].update(cam_high=np.zeros((3, 0, 5), np.uint8)), "a zero-size image (5x0)"),
])
def test_a_bad_observation_is_refused_naming_the_key(aloha, change, needle):
    obs = aloha_obs()
    change(obs)
    with pytest.raises(RequestError) as err:
        aloha.infer(obs, seq=0)
    assert needle in str(err.value)
    # the policy goes on serving
    assert aloha.infer(aloha_obs(), seq=0)["actions"].shape == (16, 7)


def test_rtc_is_refused_for_an_action_token_head():
    policy = VLAPolicy(load_config(testing.config_path("vla_openvla.yaml")).with_overrides(
        executor={"backend": "mock", "graph_dir": ""}))
    try:
        obs = {"observation/image": np.zeros((64, 64, 3), np.uint8),
               "rtc": {"prev_chunk": np.zeros((2, 7)), "inference_delay": 1}}
        with pytest.raises(RequestError, match="guides a flow-matching head; this model's head is autoregressive"):
            policy.infer(obs, seq=0)
    finally:
        policy.close()


def test_the_serve_section_is_checked_at_load():
    cfg = load_config(testing.config_path("vla_demo_orin.yaml"))
    with pytest.raises(ConfigError, match="serve.images: wrist is not a camera of the model"):
        cfg.with_overrides(serve={"images": {"wrist": "observation/wrist"}})
    with pytest.raises(ConfigError, match=r"serve.state\[1\]: expected a key"):
        cfg.with_overrides(serve={"state": ["a", 3]})
    with pytest.raises(ConfigError, match="serve.prompt: expected a key"):
        cfg.with_overrides(serve={"prompt": []})
