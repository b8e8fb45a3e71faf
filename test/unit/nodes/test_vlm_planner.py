"""The planner's topics match vla_node's: its goal is taken as vla_node takes an instruction, and its subtask
reaches both of vla_node's instruction subscriptions. Off by default."""
from __future__ import annotations

from rclpy.qos import DurabilityPolicy

from synflux_ros.nodes import vla_node, vlm_node, vlm_planner


def _key(qos):
    return qos.depth, qos.reliability, qos.durability, qos.history


def test_the_goal_is_subscribed_as_vla_node_subscribes_its_instruction():
    assert [_key(q) for q in vlm_planner.GOAL_QOS] == [_key(q) for q in vla_node.INSTRUCTION_QOS]


def test_the_subtask_is_published_latched_as_one_of_vla_node_s_instruction_subscriptions_takes():
    assert _key(vlm_planner.SUBTASK_QOS) in [_key(q) for q in vla_node.INSTRUCTION_QOS]
    assert vlm_planner.SUBTASK_QOS.durability == DurabilityPolicy.TRANSIENT_LOCAL


def test_the_planner_is_off_by_default():
    defaults = {p.name: p.default for p in vlm_node.PARAMS}
    assert defaults["planner_period"] == 0.0 and isinstance(defaults["planner_period"], float)
    assert defaults["planner_goal"] == ""
    assert "{goal}" in defaults["planner_prompt"]
    assert 1 <= defaults["planner_max_new_tokens"] <= vlm_planner.MAX_PLANNER_TOKENS
