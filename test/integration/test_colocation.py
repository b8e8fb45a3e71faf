"""vla_node and vlm_node on one machine, as processes over DDS: the sharing parameters reach the threads
(command thread real-time, chat threads idle, core sets), a missing privilege is a warning while the node
serves, bad values are refused naming the parameter, and the accelerator arbiter orders the two nodes'
graph calls (a frame waits for at most the chat's running call; chat calls wait while frames run)."""
from __future__ import annotations

import os
import textwrap
import time

import pytest
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_srvs.srv import SetBool

from synflux_ros.srv import Chat
from synflux_ros.tools.harness import call_service, rgb_image, spin_until

JOINTS = [f"joint_{i}" for i in range(7)]
SCHED_OTHER, SCHED_FIFO, SCHED_IDLE = 0, 1, 5


def threads(pid: int) -> list[dict]:
    """Each thread's policy, real-time priority and allowed cores, from /proc."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/{pid}/task/{tid}/status") as fh:
                status = dict(line.split(":\t", 1) for line in fh.read().splitlines() if ":\t" in line)
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # fields from the 3rd (state) on
        out.append({"tid": int(tid), "rt_priority": int(fields[37]), "policy": int(fields[38]),
                    "cpus": status["Cpus_allowed_list"].strip()})
    return out


class Diagnostics:
    def __init__(self, node):
        self.latest = {}
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on, 50)

    def _on(self, msg):
        for st in msg.status:
            self.latest[st.name.split(":")[0]] = {kv.key: kv.value for kv in st.values}

    def wait(self, node, name, predicate, timeout=30.0):
        ok = spin_until(node, lambda: name in self.latest and predicate(self.latest[name]), timeout)
        assert ok, f"{name}: {self.latest.get(name)}"
        return self.latest[name]


def test_the_command_thread_runs_real_time_and_the_chat_idle_on_their_cores(start_node, client, tmp_path):
    if not hasattr(os, "sched_setscheduler"):
        pytest.skip("Linux scheduling")
    arbiter = str(tmp_path / "arbiter")
    vla = start_node("vla_node", {"executor": "mock", "joint_names": JOINTS, "command_scheduling": "fifo:80",
                                  "cpus": "0", "accelerator_arbiter": arbiter, "diagnostics_period": 0.3},
                     namespace="/share")
    vlm = start_node("vlm_node", {"executor": "mock", "model_scheduling": "idle", "accelerator_arbiter": arbiter,
                                  "diagnostics_period": 0.3}, namespace="/share")
    diag = Diagnostics(client)
    d = diag.wait(client, "/share/vla_node", lambda v: int(v.get("control_ticks", 0)) > 10)
    assert d["model_scheduling"] == "normal" and d["cpus"] == "0"
    permitted = d["sharing_warnings"] == ""  # real-time needs CAP_SYS_NICE or rtprio: else a warning
    assert permitted or "command_scheduling fifo:80" in d["sharing_warnings"]
    for key in ("cpu_wait_ms", "cpu_wait_share", "arbiter_waits", "arbiter_wait_ms", "arbiter_held_ms",
                "control_late_p99_ms", "control_recent_max_late_ms"):
        assert key in d
    d = diag.wait(client, "/share/vlm_node", lambda v: True)
    assert d["model_scheduling"] == "idle" and d["sharing_warnings"] == "" and "arbiter_waits" in d
    ts = threads(vla.proc.pid)
    rt = [t for t in ts if t["policy"] == SCHED_FIFO]
    assert len(rt) == (1 if permitted else 0) and all(t["rt_priority"] == 80 for t in rt), ts  # the command thread
    assert {t["cpus"] for t in ts} == {"0"}, ts  # every thread on core 0, the model's included
    ts = threads(vlm.proc.pid)
    assert {t["policy"] for t in ts} == {SCHED_IDLE}, ts  # every thread of the chat, DDS and model pools too


def test_without_the_privilege_the_node_warns_and_serves(start_node, client, tmp_path):
    """Real-time scheduling refused (no CAP_SYS_NICE, rtprio 0): said in the log and /diagnostics; the node
    configures, commands and publishes as it would without the setting."""
    launcher = tmp_path / "unprivileged.py"
    launcher.write_text(textwrap.dedent("""
        import ctypes, resource, runpy, sys
        resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
        # CAP_SYS_NICE out of this (the only) thread's sets before any other thread exists: they inherit it
        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                        ("inheritable", ctypes.c_uint32)]
        libc = ctypes.CDLL(None, use_errno=True)
        header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
        assert libc.capget(ctypes.byref(header), data) == 0
        for d in data:
            d.effective &= ~(1 << 23)  # CAP_SYS_NICE
            d.permitted &= ~(1 << 23)
            d.inheritable &= ~(1 << 23)
        assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
    """))
    vla = start_node("vla_node", {"executor": "mock", "joint_names": JOINTS, "command_scheduling": "fifo:80",
                                  "diagnostics_period": 0.3}, namespace="/noprio", launcher=(str(launcher),))
    diag = Diagnostics(client)
    d = diag.wait(client, "/noprio/vla_node", lambda v: int(v.get("control_ticks", 0)) > 10, timeout=60)
    assert "command_scheduling fifo:80" in d["sharing_warnings"]
    assert "not permitted" in d["sharing_warnings"] and "CAP_SYS_NICE" in d["sharing_warnings"]
    assert "rtprio 80" in vla.output()
    assert all(t["policy"] == SCHED_OTHER for t in threads(vla.proc.pid))
    # and it serves: frames in, chunks out
    pub = client.create_publisher(Image, "/noprio/image", qos_profile_sensor_data)
    d = None
    for i in range(200):
        pub.publish(rgb_image(448, 448, i))
        spin_until(client, lambda: False, 0.05)
        if int(diag.latest["/noprio/vla_node"].get("frames_published", 0)) >= 3:
            break
    assert int(diag.latest["/noprio/vla_node"]["frames_published"]) >= 3


@pytest.mark.parametrize("node,param,value,words", [
    ("vla_node", "cpus", "0-999", "no core"),
    ("vla_node", "model_scheduling", "fifo", "priority 1..99"),
    ("vla_node", "command_scheduling", "idle", "needs normal or a real-time policy"),
    ("vla_node", "command_cpus", "x", "not a core number"),
    ("vlm_node", "model_scheduling", "realtime", "one of"),
    ("vlm_node", "accelerator_arbiter", "/no/such/dir/lock", "no directory"),
])
def test_bad_sharing_parameters_are_refused_naming_them(start_node, node, param, value, words):
    params = {"executor": "mock", param: value}
    if node == "vla_node":
        params["joint_names"] = JOINTS
    p = start_node(node, params, namespace="/bad")
    deadline = time.monotonic() + 60
    while p.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not p.alive() and p.proc.returncode == 1, "started with a bad parameter"
    lines = [x for x in p.output().splitlines() if f"parameter '{param}'" in x]
    assert len(lines) == 1 and words in lines[0] and value in lines[0] and node in lines[0], p.output()[-3000:]


def test_the_arbiter_orders_frames_before_chat_calls(start_node, client, make_config, tmp_path):
    """Chat graph calls of 30 ms (simulated) run back to back; frames come at 10 Hz. A frame waits for at most
    the one call running when it came; the chat's calls wait while frames run; both are counted."""
    arbiter = str(tmp_path / "arbiter")
    vla_cfg = make_config("vla_demo_orin.yaml", executor={"backend": "mock", "latency_ms": {"vision_encoder": 5.0,
                                                                                          "action_expert": 2.0}})
    vlm_cfg = make_config("vlm_demo.yaml", executor={"backend": "mock", "latency_ms": {"decode": 30.0,
                                                                                      "prefill": 30.0}},
                          text={"max_new_tokens": 40})
    start_node("vla_node", {"config": vla_cfg, "accelerator_arbiter": arbiter, "diagnostics_period": 0.3},
               namespace="/arb")
    start_node("vlm_node", {"config": vlm_cfg, "accelerator_arbiter": arbiter, "diagnostics_period": 0.3},
               namespace="/arb")
    diag = Diagnostics(client)
    diag.wait(client, "/arb/vla_node", lambda v: True)
    diag.wait(client, "/arb/vlm_node", lambda v: True)
    chat = client.create_client(Chat, "/arb/chat")
    assert chat.wait_for_service(timeout_sec=30)
    pub = client.create_publisher(Image, "/arb/image", qos_profile_sensor_data)
    futures, i = [], 0
    end = time.monotonic() + 8.0
    while time.monotonic() < end:
        if not futures or futures[-1].done():
            futures.append(chat.call_async(Chat.Request(session_id="s", prompt="hello there", reset=True)))
        pub.publish(rgb_image(448, 448, i))
        i += 1
        spin_until(client, lambda: False, 0.1)
    spin_until(client, lambda: futures[-1].done(), 30)
    assert all(f.result().success for f in futures if f.done())
    t = time.monotonic()
    d_vla = diag.wait(client, "/arb/vla_node", lambda v: int(v["frames_published"]) >= 40)
    d_vlm = diag.wait(client, "/arb/vlm_node", lambda v: True)
    assert diag.latest  # fresh reports after the load
    assert time.monotonic() - t < 30
    assert int(d_vlm["arbiter_waits"]) > 10, d_vlm  # chat calls held off while frames ran
    assert int(d_vla["arbiter_waits"]) > 0, d_vla  # frames that found a chat call running
    # no frame let a chat call start after it came, save the one taking its locks at that instant
    assert int(d_vla["arbiter_max_calls_passed"]) <= 1, d_vla
    assert float(d_vla["arbiter_max_wait_ms"]) > 0
    assert float(d_vla["arbiter_held_ms"]) > 0
