#!/usr/bin/env python3
"""Drive a policy server with openpi's own client, ``openpi_client.websocket_client_policy``.

Run it with the interpreter of ``.venv-openpi`` (``make openpi-venv``: PyPI's openpi-client, the code of
``packages/openpi-client`` in openpi's repository). Usage: ``openpi_client_run.py JOB.json``. The job names the
server (``host``, ``port``, optional ``api_key``), an output directory ``out`` and ``requests``: each a map of
observation keys to ``.npy`` files (arrays), numbers, lists or strings; a key may be a path ``"a/b"`` only when
``nested`` lists it, which puts the value at ``obs["a"]["b"]`` (ALOHA's ``images/cam_high``). It writes the
metadata frame and each result's timings to ``out/result.json`` and each result's ``actions`` to
``out/actions_<i>.npy``; a request the server refuses ends the run with the server's text in ``error``.
"""
import json
import os
import sys

import numpy as np


def load(value):
    if isinstance(value, str) and value.endswith(".npy"):
        return np.load(value, allow_pickle=False)
    if isinstance(value, dict):
        return {k: load(v) for k, v in value.items()}
    return value


def main(job_file: str) -> int:
    with open(job_file, encoding="utf-8") as fh:
        job = json.load(fh)
    from openpi_client import websocket_client_policy  # .venv-openpi's (it is not in the package's venv)
    out = job["out"]
    policy = websocket_client_policy.WebsocketClientPolicy(host=job["host"], port=job["port"],
                                                           api_key=job.get("api_key"))
    result = {"metadata": policy.get_server_metadata(), "results": []}
    try:
        for i, request in enumerate(job["requests"]):
            obs = {}
            for key, value in request.items():
                if key in job.get("nested", []):
                    outer, inner = key.split("/", 1)
                    obs.setdefault(outer, {})[inner] = load(value)
                else:
                    obs[key] = load(value)
            reply = policy.infer(obs)
            np.save(os.path.join(out, f"actions_{i}.npy"), np.asarray(reply["actions"]))
            result["results"].append({"server_timing": reply["server_timing"],
                                      "policy_timing": reply["policy_timing"],
                                      "dtype": str(reply["actions"].dtype)})
    except RuntimeError as exc:  # the client raises the server's error frame
        result["error"] = str(exc)
    with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
