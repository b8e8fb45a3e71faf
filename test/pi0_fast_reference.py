"""The LeRobot π0-FAST reference runner (LeRobot 0.4.4 in .venv-pi0ref, 0.6.1 in .venv-lerobot06) the π0-FAST parity
tests share."""
from __future__ import annotations

import pi0_reference
from pi0_reference import LEROBOT_VENVS, ROOT, lerobot_params  # noqa: F401  (the tests' parameters)

REF_PY = LEROBOT_VENVS["lerobot044"][0]
REF_SCRIPT = ROOT / "test" / "reference" / "lerobot_pi0_fast.py"


def reference(*args: str, lerobot: str = "lerobot044", timeout: float = 600) -> dict:
    """Run the reference script (``make-checkpoint``, ``run``, ``decode``, ``encode``, ``check``) in the venv of
    the LeRobot release ``lerobot``; its last stdout line is a JSON result."""
    return pi0_reference.reference(*args, lerobot=lerobot, script=REF_SCRIPT, timeout=timeout)
