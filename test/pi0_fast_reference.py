"""The LeRobot π0-FAST reference runner (LeRobot 0.4.4 in .venv-pi0ref) the π0-FAST parity tests share."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REF_PY = ROOT / ".venv-pi0ref" / "bin" / "python"
REF_SCRIPT = ROOT / "test" / "reference" / "lerobot_pi0_fast.py"


def reference(*args: str, timeout: float = 600) -> dict:
    """Run the reference script in its venv (``make-checkpoint``, ``run``, ``decode``, ``encode``, ``check``); its
    last stdout line is a JSON result."""
    proc = subprocess.run([str(REF_PY), str(REF_SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, f"reference {args[0]} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
