"""The planner's text side (synflux_ros.runtimes.planner), without ROS: goals, the prompt, answers to subtasks."""
from __future__ import annotations

import pytest

from synflux_ros.runtimes.planner import (DEFAULT_PROMPT, GOAL_FIELD, MAX_GOAL_CHARS, check_prompt_template,
                                          goal_text, planner_prompt, subtask_from_reply)
from synflux_ros.runtimes.vla import MAX_INSTRUCTION_CHARS, instruction_text


@pytest.mark.parametrize("reply,subtask", [
    ("pick up the red block", "pick up the red block"),
    ("  grasp the cup  \nthen lift it", "grasp the cup"),
    ("\n\n   \n\tOpen the drawer.\nClose it.", "Open the drawer."),
    ("move left\r\nmove right", "move left"),
    ("\x01\x03reach\x00 the\x7f handle\x02", "reach the handle"),  # control characters of a byte-level model
    ("\x01\x02\n  lift  ", "lift"),  # a line of control characters only counts as empty
    ("\ufffd9\ufffd", "\ufffd9\ufffd"),  # what the model said, replacement characters and all
    ("2", "2"),
])
def test_the_first_line_with_text_is_the_subtask(reply, subtask):
    assert subtask_from_reply(reply) == subtask


@pytest.mark.parametrize("reply", ["", "   ", "\n\n", " \t\r\n ", "\x00\x01", "...", "**\nlift the cup", "-- !"])
def test_an_answer_without_a_subtask_gives_nothing(reply):
    assert subtask_from_reply(reply) == ""


def test_a_long_answer_is_cut_to_the_instruction_limit():
    word = "forward "
    reply = word * (MAX_INSTRUCTION_CHARS // len(word) + 10)
    subtask = subtask_from_reply(reply)
    assert len(subtask) <= MAX_INSTRUCTION_CHARS and subtask == subtask.strip()
    assert reply.startswith(subtask)
    assert subtask_from_reply("abcdef", limit=3) == "abc"
    assert subtask_from_reply("ab  def", limit=4) == "ab"  # no trailing space after the cut


@pytest.mark.parametrize("reply", ["pick up the red block", " x \n", "\x01go\x02", "y" * 5000, "é" * 2001])
def test_every_subtask_is_an_instruction_vla_node_takes_as_it_is(reply):
    """What the planner publishes is what vla_node applies: instruction_text leaves it unchanged."""
    subtask = subtask_from_reply(reply)
    assert subtask and instruction_text(subtask) == subtask


def test_goals_are_checked_and_stripped():
    assert goal_text("  tidy the table \n") == "tidy the table"
    assert goal_text("x" * MAX_GOAL_CHARS) == "x" * MAX_GOAL_CHARS
    with pytest.raises(ValueError, match="goal is empty"):
        goal_text(" \n\t")
    with pytest.raises(ValueError, match=f"goal has {MAX_GOAL_CHARS + 1} characters \\(limit {MAX_GOAL_CHARS}\\)"):
        goal_text("x" * (MAX_GOAL_CHARS + 1))
    with pytest.raises(ValueError, match="goal must be text"):
        goal_text(None)


def test_the_prompt_template_places_the_goal():
    assert GOAL_FIELD in DEFAULT_PROMPT and check_prompt_template(DEFAULT_PROMPT) == DEFAULT_PROMPT
    assert planner_prompt("Goal: {goal}. Next {step}? ({goal})", "stack {cubes}") == \
        "Goal: stack {cubes}. Next {step}? (stack {cubes})"
    for bad in ("no place for it", "", "{Goal}", 3):
        with pytest.raises(ValueError, match=r"\{goal\}"):
            check_prompt_template(bad)
