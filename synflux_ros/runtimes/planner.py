"""The VLM as the VLA's planner, ROS-free: the question asked for a goal and the subtask taken from the answer.

vlm_node's planner mode (docs/ros-interfaces.md, "Planner mode") asks its chat model, at a set period and
with the latest camera frame, for the next subtask towards a goal, and publishes the answer as vla_node's
instruction. This module holds the text side of that exchange: :func:`goal_text` checks a goal,
:func:`planner_prompt` fills the prompt template, and :func:`subtask_from_reply` turns a reply into an
instruction vla_node takes, or into nothing when the reply holds none.
"""
from __future__ import annotations

import unicodedata

from .vla import MAX_INSTRUCTION_CHARS, bounded_text

GOAL_FIELD = "{goal}"
"""Where the goal goes in the prompt template."""
MAX_GOAL_CHARS = MAX_INSTRUCTION_CHARS
"""A goal is an instruction of a longer horizon: it has the same limit."""
DEFAULT_PROMPT = ("You direct a robot arm towards this goal: {goal}\n"
                  "Look at the camera image and answer with the next subtask only, as one short instruction "
                  "on one line.")


def goal_text(text) -> str:
    """A goal stripped; ValueError when it is not text, is empty or is longer than MAX_GOAL_CHARS."""
    return bounded_text(text, "goal", MAX_GOAL_CHARS)


def check_prompt_template(template) -> str:
    """The prompt template as given; ValueError when it is not text or has no place for the goal."""
    if not isinstance(template, str) or GOAL_FIELD not in template:
        raise ValueError(f"must be text holding {GOAL_FIELD} where the goal goes, got {template!r}")
    return template


def planner_prompt(template: str, goal: str) -> str:
    """The question for ``goal``: each {goal} of the template replaced (other braces are kept as written)."""
    return template.replace(GOAL_FIELD, goal)


def _visible(line: str) -> str:
    """``line`` without control characters (a byte-level model can answer them), stripped."""
    return "".join(ch for ch in line if unicodedata.category(ch) != "Cc").strip()


def subtask_from_reply(reply: str, limit: int = MAX_INSTRUCTION_CHARS) -> str:
    """The next subtask in a reply: its first line that holds any visible character, without control
    characters, stripped and cut to ``limit`` characters (vla_node's instruction limit). "" when the reply
    holds no such line, or when that line has no letter or digit ("...", "**"): nothing to instruct."""
    for line in reply.splitlines():
        text = _visible(line)
        if text:
            break
    else:
        return ""
    if not any(ch.isalnum() for ch in text):
        return ""
    return text[:limit].rstrip()
