"""synflux-serve's arguments, checked before Ray starts, and the Serve config file it writes."""
from __future__ import annotations

import pytest
import yaml

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (make serve-venv)")
from synflux_ros.serve import app, cli  # noqa: E402
from synflux_ros.tools import harness as testing  # noqa: E402

VLA = testing.config_path("vla_demo_orin.yaml")


def test_dry_run_writes_a_serve_config_file_ray_accepts(tmp_path, capsys):
    from ray.serve.schema import ServeDeploySchema
    key = tmp_path / "key"
    key.write_text("0123456789abcdef0123\n")
    out = tmp_path / "serve.yaml"
    assert cli.main(["--config", VLA, "--autoscale", "1:4", "--cpus-per-replica", "0.5", "--host", "0.0.0.0",
                     "--port", "9000", "--api-key-file", str(key), "--write-config", str(out), "--dry-run"]) == 0
    written = yaml.safe_load(out.read_text())
    schema = ServeDeploySchema.model_validate(written)
    assert (schema.http_options.host, schema.http_options.port) == ("0.0.0.0", 9000)
    application = schema.applications[0]
    assert application.import_path == "synflux_ros.serve.app:build_app"
    assert application.args == {"config": VLA, "api_key_file": str(key)}
    dep = application.deployments[0]
    assert dep.name == "vla_policy" and dep.ray_actor_options.num_cpus == 0.5 and dep.max_ongoing_requests == 16
    assert written["applications"][0]["deployments"][0]["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 1}
    # the file's application is what the builder makes of its entry (Ray calls it with the args alone)
    assert app.build_app(application.args) is not None
    assert app.application(application.args, written["applications"][0]["deployments"][0]) is not None


@pytest.mark.parametrize("argv,needle", [
    (["--config", "missing.yaml"], "--config: 'missing.yaml' is not a file"),
    (["--config", VLA, "--tls-cert", VLA], "--tls-cert and --tls-key go together"),
    (["--config", VLA, "--graph-dir", "/nonexistent"], "is not a directory"),
    (["--config", VLA, "--replicas", "0"], "--replicas: 0 (at least 1)"),
    (["--config", VLA, "--max-ongoing-requests", "0"], "--max-ongoing-requests: 0 (at least 1)"),
    (["--config", VLA, "--backend", "tpu"], "unknown backend 'tpu'"),
    (["--config", VLA, "--temp-dir", "/tmp/" + "d" * 40], "is too long for Ray's socket paths: at most 43"),
    (["--config", VLA, "--temp-dir", "/tmp/r", "--address", "auto"], "--temp-dir is for a local Ray"),
    (["--config", VLA, "--inline-kib", "0"], "--inline-kib: 0 (at least 1)"),
    (["--config", VLA, "--inline-kib", "512", "--address", "auto"], "--inline-kib is for a local Ray"),
])
def test_bad_arguments_exit_2_naming_the_fault(argv, needle, capsys):
    assert cli.main(argv + ["--dry-run"]) == 2
    assert needle in capsys.readouterr().err


def test_session_affinity_can_be_switched_off_for_comparison(tmp_path):
    out = tmp_path / "serve.yaml"
    assert cli.main(["--config", testing.config_path("vlm_demo.yaml"), "--no-session-affinity",
                     "--write-config", str(out), "--dry-run"]) == 0
    application = yaml.safe_load(out.read_text())["applications"][0]
    assert application["args"]["session_affinity"] is False and application["deployments"][0]["name"] == "vlm_chat"


def test_a_short_api_key_is_refused(tmp_path, capsys):
    key = tmp_path / "key"
    key.write_text("short\n")
    assert cli.main(["--config", VLA, "--api-key-file", str(key), "--dry-run"]) == 2
    assert "holds a key of 5 characters; use at least 16" in capsys.readouterr().err


def test_the_api_key_is_compared_whole():
    key = "0123456789abcdef0123"
    assert app.authorised({"authorization": f"Api-Key {key}"}, key)  # openpi-client's header
    assert app.authorised({"authorization": f"Bearer {key}"}, key)  # OpenAI's
    for given in ("", key, f"Api-Key {key[:-1]}", f"Api-Key {key}0", f"Bearer  {key}", f"Basic {key}",
                  f"api-key {key}", f"Api-Key{key}"):
        assert not app.authorised({"authorization": given}, key), given
    assert app.authorised({}, "")  # no key configured: no header asked for


def test_a_local_ray_gets_a_temp_dir_its_socket_paths_fit_in(monkeypatch):
    """Ray refuses to start where a socket path passes 107 bytes, as under a deep $TMPDIR (a CI checkout's build
    folder): a shorter dir is taken then, and said."""
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", "/tmp/build")
    assert cli.ray_temp_dir("") == ("/tmp/build/ray", "")
    deep = "/home/builder/" + "x" * 40 + "/build/tmp"
    monkeypatch.setenv("TMPDIR", deep)
    where, why = cli.ray_temp_dir("")
    assert len(where + "/session_2026-11-26_09-42-17_864114_2730700/sockets/plasma_store") <= 107
    assert f"{deep}/ray makes socket paths longer than 107 bytes" in why and where in why
    monkeypatch.setenv("RAY_TMPDIR", "/tmp/r")  # Ray's own variable comes first
    assert cli.ray_temp_dir("") == ("/tmp/r/ray", "")
    assert cli.ray_temp_dir("/tmp/mine") == ("/tmp/mine", "")


def test_a_local_ray_passes_camera_frames_inside_the_proxys_calls():
    """Ray's default puts objects over 100 KiB (a 224x224 frame is 147 KiB) in the object store between the
    proxy and a replica; synflux-serve's local Ray raises the bound to --inline-kib."""
    a = cli.parser().parse_args(["--config", VLA])
    options = cli.local_ray_options(a, "/tmp/r")
    assert options["address"] == "local" and options["_temp_dir"] == "/tmp/r"
    assert options["_system_config"]["max_direct_call_object_size"] == cli.INLINE_KIB * 1024 > 224 * 224 * 3
    a = cli.parser().parse_args(["--config", VLA, "--inline-kib", "256", "--num-cpus", "2"])
    options = cli.local_ray_options(a, "")
    assert options["_system_config"]["max_direct_call_object_size"] == 256 * 1024 and options["num_cpus"] == 2
