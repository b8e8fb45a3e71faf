"""The merge-mode table: one function per mode of the config, a docs row each, and a mode added by a function."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

from synflux_ros.core.config import EXECUTION_MODES, GUIDED_MODES, ExecutionConfig
from synflux_ros.execution import merge
from synflux_ros.execution.plan import ChunkPlan

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "execution.md")
H, P = 6, 0.02


def test_every_mode_of_the_config_has_one_function_and_one_docs_row():
    assert set(merge.MERGES) == set(EXECUTION_MODES) - {"auto"}
    section = open(DOCS, encoding="utf-8").read().split("## Merge modes", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([a-z_]+)`", section, re.M))
    assert rows == set(EXECUTION_MODES), rows ^ set(EXECUTION_MODES)
    assert GUIDED_MODES <= set(EXECUTION_MODES)


@pytest.mark.parametrize("mode", EXECUTION_MODES)
def test_only_guided_modes_guide_inference_and_keep_the_model_rows(mode):
    cfg = ExecutionConfig(joints=("a",), mode=mode)
    assert cfg.guides_inference == (mode == "rtc")
    p = ChunkPlan(cfg, P, H)
    raw = np.ones((H, 1))
    p.offer(np.zeros((H, 1)), 10.0, 10.0, raw=raw if cfg.guides_inference else None)
    assert (p.leftover(10.0) is not None) == cfg.guides_inference


@pytest.mark.parametrize("mode", sorted(merge.MERGES))
def test_every_merge_keeps_the_rows_past_the_old_plan_and_the_callers_arrays(mode):
    cfg = ExecutionConfig(joints=("a", "b"), mode=mode)
    new, old = np.full((4, 2), 2.0), np.full((4, 2), 1.0)
    old[2:] = np.nan  # the old plan ends after two rows
    mask = np.isfinite(old).all(axis=1)
    kept = old.copy()
    rows, counts = merge.MERGES[mode](merge.Overlap(new.copy(), old, mask, np.ones(4, np.int64), cfg, H))
    assert rows.shape == (4, 2) and counts.shape == (4,)
    np.testing.assert_array_equal(rows[2:], 2.0)  # nothing to merge with
    assert np.all((rows[:2] >= 1.0) & (rows[:2] <= 2.0))  # a convex combination where they overlap
    np.testing.assert_array_equal(old, kept)
    np.testing.assert_array_equal(counts[2:], 1)


def test_a_new_mode_is_one_function_in_the_table(monkeypatch):
    def halfway(o):
        out = o.new
        out[o.mask] = 0.5 * (o.old[o.mask] + out[o.mask])
        return out, np.ones(len(out), np.int64)
    monkeypatch.setitem(merge.MERGES, "average", halfway)  # stands in for a new name, which the config lists
    p = ChunkPlan(ExecutionConfig(joints=("a",), mode="average"), P, H)
    p.offer(np.zeros((H, 1)), 10.0, 10.0)
    p.offer(np.ones((H, 1)), 10.0, 10.0)
    np.testing.assert_allclose(p.actions[:, 0], 0.5)


def test_blend_weights_are_lerobots():
    o = merge.Overlap(np.full((1, 1), 1.0), np.zeros((1, 1)), np.ones(1, bool), np.ones(1, np.int64),
                      ExecutionConfig(joints=("a",)), H)
    for mode, w_new in (("weighted_average", 0.7), ("average", 0.5), ("conservative", 0.3), ("latest_only", 1.0)):
        rows, _ = merge.MERGES[mode](merge.Overlap(o.new.copy(), o.old, o.mask, o.counts, o.cfg, H))
        assert rows[0, 0] == pytest.approx(w_new), mode
