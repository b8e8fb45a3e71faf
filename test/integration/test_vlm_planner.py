"""vlm_node as vla_node's planner, both as processes over real DDS: a goal and camera frames in, the subtask the
VLM answers published on ``instruction`` and applied by vla_node. The demo models have random weights, so the
subtasks are gibberish: what is checked is that what vlm_node published is what vla_node applied, and the
planner's counts."""
from __future__ import annotations

import itertools
import time
import uuid

import pytest
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image
from std_msgs.msg import String

from synflux_ros.runtimes.vla import MAX_INSTRUCTION_CHARS
from synflux_ros.tools import harness as testing
from synflux_ros.tools.harness import rgb_image, spin_until

from ros_clients import LATCHED, ChatClient, Harness, ok  # noqa: E402

NS = "/planner"
PLANNER = {"config": "vlm_demo.yaml", "executor": "mock", "diagnostics_period": 0.2, "planner_period": 0.3,
           # short answers: the byte-level demo VLA takes about 90 tokens of instruction beside its image tokens
           "planner_max_new_tokens": 12}


class PlannerWatch:
    """The client side of vlm_node's planner: the goal publisher, the subtasks it publishes on ``instruction``
    and its ``/diagnostics`` values."""

    def __init__(self, node, ns: str):
        self.node, self.ns = node, ns
        self.goal_pub = node.create_publisher(String, f"{ns}/goal", LATCHED)
        self.subtasks, self.diags = [], []
        node.create_subscription(String, f"{ns}/instruction", lambda m: self.subtasks.append(m.data), LATCHED)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 50)

    def _on_diag(self, msg):
        for st in msg.status:
            if st.name.startswith(f"{self.ns}/vlm_node:"):
                self.diags.append({kv.key: kv.value for kv in st.values})

    def diag_where(self, predicate, timeout=20.0, while_waiting=None):
        """The latest diagnostics matching ``predicate``; ``while_waiting()`` is called every 0.1 s meanwhile."""
        found = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [d for d in self.diags if "planner_requests" in d and predicate(d)]
            if found:
                return found[-1]
            if while_waiting is not None:
                while_waiting()
            spin_until(self.node, lambda: False, 0.1)
        raise AssertionError(f"no vlm_node diagnostics matching; last: {self.diags[-1:]}")


def counts(d: dict, *keys: str) -> tuple[int, ...]:
    return tuple(int(d[f"planner_{k}"]) for k in keys)


@pytest.fixture()
def pair(start_node, client):
    """vla_node and vlm_node with the planner on, in one namespace; (vla harness, planner watch, the frames
    sender: each call publishes a new frame on ``image``, which both nodes take)."""
    start_node("vla_node", {"config": "vla_demo_orin.yaml", "executor": "mock", "diagnostics_period": 0.2},
               namespace=NS)
    vlm = start_node("vlm_node", PLANNER, namespace=NS)
    vla = Harness(client, NS)
    watch = PlannerWatch(client, NS)
    vla.wait_connected()
    assert vlm.wait_output("planner every 0.3 s", 60), vlm.output()[-3000:]
    seq = [0]

    def frame():
        seq[0] += 1
        vla.image_pub.publish(rgb_image(224, 224, seq[0]))
    return vla, watch, frame


def test_the_planner_s_subtask_is_what_vla_node_applies(pair, client):
    vla, watch, frame = pair
    # Nothing is asked without a goal, nor without a frame: counted, visible in /diagnostics.
    d = watch.diag_where(lambda d: counts(d, "no_goal")[0] >= 2)
    assert counts(d, "requests", "published") == (0, 0) and d["planner_goal"] == ""
    watch.goal_pub.publish(String(data="  put the cup on the shelf  "))
    d = watch.diag_where(lambda d: counts(d, "no_image")[0] >= 2)
    assert d["planner_goal"] == "put the cup on the shelf" and counts(d, "requests") == (0,)

    # With the demo's random weights and the default prompt, this goal is answered with end-of-sequence at
    # once: an empty answer, counted and not published.
    d = watch.diag_where(lambda d: counts(d, "empty_answers")[0] >= 2, while_waiting=frame)
    assert counts(d, "published") == (0,) and "no subtask in the answer" in d["planner_last_error"]
    assert not watch.subtasks and vla.diag_where(lambda d: True)["instruction"] == "pick up the red block"

    # This one is answered with text: published, and vla_node applies exactly what was published.
    watch.goal_pub.publish(String(data="pick up the red block"))
    d = watch.diag_where(lambda d: counts(d, "published")[0] >= 1, while_waiting=frame)
    assert d["planner_goal"] == "pick up the red block"
    assert spin_until(client, lambda: bool(watch.subtasks), 10), "nothing arrived on instruction"
    subtask = watch.subtasks[-1]
    assert subtask and subtask == subtask.strip() and len(subtask) <= MAX_INSTRUCTION_CHARS
    assert subtask == d["planner_last_subtask"]
    applied = vla.diag_where(lambda d: d.get("instruction") == subtask, timeout=20)
    assert applied["instructions_rejected"] == "0"
    assert float(d["planner_last_latency_ms"]) > 0 and counts(d, "failed") == (0,)
    assert counts(d, "requests")[0] >= counts(d, "published")[0] + counts(d, "empty_answers")[0]

    # The same answer on the next frames is not published again.
    d = watch.diag_where(lambda d: counts(d, "unchanged")[0] >= 3, while_waiting=frame)
    assert counts(d, "published") == (1,) and d["planner_last_subtask"] == subtask
    assert watch.subtasks == [subtask]


SOLO = "/planner_solo"
GOAL_NUMBERS = itertools.count()


@pytest.fixture(scope="module")
def solo(ros_env):
    """One vlm_node planning without vla_node, shared by the cases that each check it goes on after a bad goal or
    frame; (planner watch, the frames sender: each call publishes the given image or a new good frame, chat
    client)."""
    import rclpy
    node = rclpy.create_node(f"test_planner_{uuid.uuid4().hex[:8]}")
    with testing.NodeProcess("vlm_node", PLANNER, env=ros_env, remaps={"__ns": SOLO}) as proc:
        assert proc.wait_output("planner every 0.3 s", 60), proc.output()[-3000:]
        watch = PlannerWatch(node, SOLO)
        images = node.create_publisher(Image, f"{SOLO}/image", qos_profile_sensor_data)
        assert spin_until(node, lambda: images.get_subscription_count() > 0, 30), proc.output()[-3000:]
        seq = [0]

        def frame(msg=None):
            seq[0] += 1
            images.publish(msg or rgb_image(224, 224, seq[0]))
        yield watch, frame, ChatClient(node, SOLO)
        assert proc.alive(), proc.output()[-3000:]
    node.destroy_node()


def set_goal(watch) -> dict:
    """Publish a good goal not used before and wait until the planner holds it; its diagnostics then count every
    earlier event, so a case counts from there."""
    goal = f"wipe the table {next(GOAL_NUMBERS)}"
    watch.goal_pub.publish(String(data=goal))
    return watch.diag_where(lambda d: d["planner_goal"] == goal)


def keeps_planning(watch, frame, chat) -> None:
    before = counts(watch.diag_where(lambda d: True), "requests")[0]
    watch.diag_where(lambda d: counts(d, "requests")[0] > before, while_waiting=frame)
    ok(chat.chat("operator", "hello"))


@pytest.mark.parametrize("goal,needle", [
    ("", "goal is empty"),
    (" \n\t ", "goal is empty"),
    ("x" * (MAX_INSTRUCTION_CHARS + 1), f"goal has {MAX_INSTRUCTION_CHARS + 1} characters (limit "
                                        f"{MAX_INSTRUCTION_CHARS})"),
    ("stack the <|im_end|> cubes", "special token"),
])
def test_a_bad_goal_is_refused_and_the_previous_one_kept(solo, goal, needle):
    watch, frame, chat = solo
    good = set_goal(watch)
    before = counts(good, "goals_rejected")[0]
    watch.goal_pub.publish(String(data=goal))
    d = watch.diag_where(lambda d: counts(d, "goals_rejected")[0] > before)
    assert needle in d["planner_last_error"] and d["planner_last_error"].startswith("goal: ")
    assert d["planner_goal"] == good["planner_goal"]
    keeps_planning(watch, frame, chat)


@pytest.mark.parametrize("bad,needle", [
    (dict(encoding="16UC1"), "16UC1"),
    (dict(data=b"\x00" * 1000), "does not match"),
    (dict(width=0, step=0, data=b""), "zero"),
    (dict(height=5000, width=5000, step=15000, data=b""), "pixels"),
])
def test_a_bad_frame_is_refused_and_the_planner_goes_on(solo, bad, needle):
    watch, frame, chat = solo
    before = counts(set_goal(watch), "images_rejected")[0]
    msg = rgb_image(224, 224, 1)
    for k, v in bad.items():
        setattr(msg, k, v)
    d = watch.diag_where(lambda d: counts(d, "images_rejected")[0] > before, while_waiting=lambda: frame(msg))
    assert needle in d["planner_last_error"] and d["planner_last_error"].startswith("image: "), d
    keeps_planning(watch, frame, chat)


def test_the_planner_s_session_is_not_a_chat_session(solo):
    chat = solo[2]
    for reply in (chat.chat("_planner", "hello"), chat.end("_planner")):
        assert not reply.success and "the planner's" in reply.error, reply.error
    ok(chat.chat("_planner2", "hello"))


@pytest.mark.parametrize("params,needle", [
    ({"planner_period": -1.0}, "'planner_period'"),
    ({"planner_period": 0.01}, "'planner_period'"),
    ({"planner_period": 1.0, "planner_prompt": "what next?"}, "'planner_prompt'"),
    ({"planner_period": 1.0, "planner_max_new_tokens": 0}, "'planner_max_new_tokens'"),
    ({"planner_period": 1.0, "planner_goal": "g" * (MAX_INSTRUCTION_CHARS + 1)}, "'planner_goal'"),
])
def test_bad_planner_parameters_fail_at_startup_naming_them(start_node, params, needle):
    p = start_node("vlm_node", {"config": "vlm_demo.yaml", **params}, namespace="/bad_planner")
    deadline = time.monotonic() + 30
    while p.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not p.alive(), "node kept running with a bad parameter"
    assert p.proc.returncode == 1
    out = p.output()
    assert "vlm_node" in out and needle in out, out
