"""``synflux-serve``: serve a synflux config and graph set with Ray Serve (a local Ray, or a cluster it joins):
a VLA in openpi's websocket policy protocol, a VLM as OpenAI's chat completions API.

It writes the Serve config file it runs (``--write-config``), so that the same application can be run with
``serve run`` or deployed with ``serve deploy``; ``--dry-run`` checks the config and writes the file only.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import threading

import yaml

from ..core.config import ConfigError, load_config

APP_NAME = "synflux"
IMPORT_PATH = "synflux_ros.serve.app:build_app"
DEPLOYMENTS = {"vla": "vla_policy", "vlm": "vlm_chat"}
INLINE_KIB = 4096


def _autoscale(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX replicas, got {text!r}") from None
    if not 0 <= lo <= hi or hi < 1:
        raise argparse.ArgumentTypeError(f"expected 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return lo, hi


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="synflux-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="model config YAML")
    p.add_argument("--graph-dir", default="", help="graph set directory (default: the config's executor.graph_dir)")
    p.add_argument("--backend", default="", help="backend (default: the config's executor.backend)")
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--replicas", type=int, default=1, help="replicas of the model (default 1)")
    scale.add_argument("--autoscale", type=_autoscale, metavar="MIN:MAX",
                       help="autoscale between MIN and MAX replicas on the ongoing requests")
    p.add_argument("--max-ongoing-requests", type=int, default=16,
                   help="requests a replica takes at once; a robot's websocket counts as one for its lifetime, so "
                   "for a VLA this is the robots a replica serves (default 16)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves per replica")
    p.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs Ray reserves per replica")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default="", help="join this Ray cluster (auto, or ray://host:10001); default: "
                   "start a local Ray")
    p.add_argument("--num-cpus", type=int, default=0, help="local Ray: CPUs it may use (default all)")
    p.add_argument("--object-store-mib", type=int, default=256, help="local Ray: object store size")
    p.add_argument("--inline-kib", type=int, default=None,
                   help="local Ray: messages up to this size pass between the proxy and a replica inside the call "
                   "rather than through the object store (Ray's max_direct_call_object_size, 100 KiB by default: "
                   f"a 224x224 camera frame is 147 KiB; default {INLINE_KIB} KiB)")
    p.add_argument("--temp-dir", default="", help="local Ray: its session files and sockets (default: Ray's, "
                   "$RAY_TMPDIR or $TMPDIR, then /tmp, plus /ray; a shorter one under /tmp where that makes socket "
                   "paths longer than the 107 bytes Linux allows)")
    p.add_argument("--no-session-affinity", action="store_true",
                   help="vlm: route requests without regard to their x-session-id (for comparison)")
    p.add_argument("--api-key-file", default="", help="file holding the API key clients must send")
    p.add_argument("--tls-cert", default="", help="certificate file (PEM): serve wss:// and https://")
    p.add_argument("--tls-key", default="", help="private key file of --tls-cert")
    p.add_argument("--write-config", default="", help="write the Serve config file here")
    p.add_argument("--dry-run", action="store_true", help="check the config, write --write-config, and exit")
    return p


def serve_config(a: argparse.Namespace) -> dict:
    """The Serve config file (Ray's ServeDeploySchema) of these arguments."""
    if bool(a.tls_cert) != bool(a.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    for flag, path in (("--config", a.config), ("--tls-cert", a.tls_cert), ("--tls-key", a.tls_key),
                       ("--api-key-file", a.api_key_file)):
        if path and not os.path.isfile(path):
            raise ConfigError(f"{flag}: {path!r} is not a file")
    if a.graph_dir and not os.path.isdir(a.graph_dir):
        raise ConfigError(f"--graph-dir: {a.graph_dir!r} is not a directory")
    if a.replicas < 1:
        raise ConfigError(f"--replicas: {a.replicas} (at least 1)")
    if a.inline_kib is not None and a.inline_kib < 1:
        raise ConfigError(f"--inline-kib: {a.inline_kib} (at least 1)")
    args = {"config": os.path.abspath(a.config)}
    if a.graph_dir:
        args["graph_dir"] = os.path.abspath(a.graph_dir)
    if a.backend:
        args["backend"] = a.backend
    if a.api_key_file:
        args["api_key_file"] = os.path.abspath(a.api_key_file)
    if a.no_session_affinity:
        args["session_affinity"] = False
    actor = {"num_cpus": a.cpus_per_replica}
    if a.gpus_per_replica:
        actor["num_gpus"] = a.gpus_per_replica
    if a.max_ongoing_requests < 1:
        raise ConfigError(f"--max-ongoing-requests: {a.max_ongoing_requests} (at least 1)")
    deployment: dict = {"name": DEPLOYMENTS[load_config(a.config).mode], "ray_actor_options": actor,
                        "max_ongoing_requests": a.max_ongoing_requests}
    if a.autoscale:
        deployment["autoscaling_config"] = {"min_replicas": a.autoscale[0], "max_replicas": a.autoscale[1],
                                            "target_ongoing_requests": 1}
    else:
        deployment["num_replicas"] = a.replicas
    http = {"host": a.host, "port": a.port}
    if a.tls_cert:
        http.update(ssl_certfile=os.path.abspath(a.tls_cert), ssl_keyfile=os.path.abspath(a.tls_key))
    return {"proxy_location": "EveryNode", "http_options": http,
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH, "args": args,
                              "deployments": [deployment]}]}


# A Ray session's longest socket path below its temp dir: "/session_<date>_<time>_<us>_<pid>/sockets/plasma_store"
# (pids up to 7 digits), against the 107 bytes of an AF_UNIX path.
_RAY_SOCKET_TAIL = len("/session_2026-01-01_00-00-00_000000_1234567/sockets/plasma_store")
_UNIX_PATH_MAX = 107


def ray_temp_dir(requested: str) -> tuple[str, str]:
    """The temp dir a local Ray gets, and why where it is not the one asked for (or Ray's default): Ray fails
    to start where its socket paths exceed the AF_UNIX limit, as under a deep $TMPDIR."""
    if requested:
        if len(os.fsencode(os.path.abspath(requested))) + _RAY_SOCKET_TAIL > _UNIX_PATH_MAX:
            raise ConfigError(f"--temp-dir {requested!r} is too long for Ray's socket paths: at most "
                              f"{_UNIX_PATH_MAX - _RAY_SOCKET_TAIL} characters")
        return os.path.abspath(requested), ""
    root = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if sys.platform.startswith("linux") else "")
    default = os.path.join(root or "/tmp", "ray")
    if len(os.fsencode(default)) + _RAY_SOCKET_TAIL <= _UNIX_PATH_MAX:
        return default, ""
    short = f"/tmp/ray-{os.getuid()}"
    return short, (f"Ray's temp dir {default} makes socket paths longer than {_UNIX_PATH_MAX} bytes; "
                   f"using {short} (--temp-dir sets it)")


def local_ray_options(a: argparse.Namespace, temp_dir: str) -> dict:
    """``ray.init``'s arguments for a Ray of synflux-serve's own. Observations pass inside the proxy's calls to
    a replica up to ``--inline-kib``: through the object store, a 224x224 frame cost ~1 ms more per request and
    CPU in the raylet (docs/serving.md)."""
    # address "local": a Ray of its own, even where another runs on this machine (ray start)
    return {"address": "local", "num_cpus": a.num_cpus or None, "object_store_memory": a.object_store_mib * 2**20,
            "include_dashboard": False, "namespace": "serve", "_temp_dir": temp_dir,
            "_system_config": {"max_direct_call_object_size": (a.inline_kib or INLINE_KIB) * 1024}}


LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Set before Ray is imported, for a Ray of synflux-serve's own: Ray's node address is then loopback, and its
GCS, raylet, workers, agents and metrics listen on 127.0.0.1. Without it Ray on Linux takes the default route's
address (even when told 127.0.0.1) and those ports listen on every interface, where Ray runs code for whoever
reaches them. (Ray reads the variable once, at import; the replicas' own gRPC port: app.py.)"""


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if not a.address:
        os.environ.update(LOCAL_RAY_ENV)
    from .app import application  # Ray and FastAPI load only once the arguments hold
    try:
        if a.address and a.temp_dir:
            raise ConfigError("--temp-dir is for a local Ray; a cluster joined with --address keeps its own")
        if a.address and a.inline_kib is not None:
            raise ConfigError("--inline-kib is for a local Ray; a cluster joined with --address keeps its own "
                              "(start its head with RAY_max_direct_call_object_size set)")
        temp_dir, why = ray_temp_dir(a.temp_dir) if not a.address else ("", "")
        config = serve_config(a)
        app_cfg = config["applications"][0]
        app = application(app_cfg["args"], app_cfg["deployments"][0])
    except ConfigError as exc:
        print(f"synflux-serve: {exc}", file=sys.stderr)
        return 2
    if a.write_config:
        with open(a.write_config, "w", encoding="utf-8") as fh:
            yaml.safe_dump(config, fh, sort_keys=False)
        print(f"synflux-serve: wrote {a.write_config} (serve run / serve deploy)", flush=True)
    if a.dry_run:
        return 0

    import ray
    from ray import serve

    if a.address:
        ray.init(address=a.address, namespace="serve")
    else:
        if why:
            print(f"synflux-serve: {why}", flush=True)
        ray.init(**local_ray_options(a, temp_dir))
        node = ray.util.get_node_ip_address()
        if not ipaddress.ip_address(node).is_loopback:  # Ray was imported before the variable was set
            print(f"synflux-serve: warning: Ray's node address is {node}: its ports listen beyond loopback",
                  file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=config["http_options"], proxy_location=config["proxy_location"])
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        secure = "s" if a.tls_cert else ""
        where = (f"ws{secure}://{a.host}:{a.port}/ (openpi policy protocol)" if app_cfg["deployments"][0]["name"]
                 == DEPLOYMENTS["vla"] else f"http{secure}://{a.host}:{a.port}/v1 (OpenAI chat completions)")
        print(f"synflux-serve: serving {os.path.basename(a.config)} at {where}", flush=True)
        stop.wait()
    finally:
        if a.address:  # a cluster's Serve may run other applications: remove only this one
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
