"""The levels the ROS-free rooms report are /diagnostics' own."""
from __future__ import annotations

from synflux_ros.nodes import diagnostics
from synflux_ros.runtimes import ledger


def test_the_frame_ledger_s_levels_are_diagnostic_status_levels():
    assert (ledger.OK, ledger.WARN, ledger.ERROR) == (diagnostics.OK, diagnostics.WARN, diagnostics.ERROR)
