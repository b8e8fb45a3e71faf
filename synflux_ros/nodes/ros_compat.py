"""Every difference between the ROS 2 distributions the package runs on, in one place.

Robots run Humble (Jetson Orin, JetPack 6: rclpy 3.3, Fast DDS 2.6), Jazzy (Thor and Orin, JetPack 7: rclpy
7.1, Fast DDS 2.14) and Kilted (rclpy 9, Fast DDS 3). The rest of the package uses the names here instead of
the distribution's own, so that a new distribution has one module to check (test/unit/test_ros_api_surface.py
checks every other rclpy and launch name against Humble's and Jazzy's API, kept as data in test/data/ros_api):

* :func:`subscription_event_callbacks`: ``rclpy.event_handler`` (Iron and later) is ``rclpy.qos_event`` in
  Humble.
* :func:`executor_shutdown`: ``Executor.shutdown(wait_for_threads=)`` exists only from rclpy 7.1.12 (not in
  Humble, not in Jazzy's 7.1.6 wheel nor in apt Jazzy before September 2026).
* :func:`fastdds_profile_variables`: Fast DDS 2.x (Humble, Jazzy) reads its XML profile from
  ``FASTRTPS_DEFAULT_PROFILES_FILE`` and silently ignores ``FASTDDS_DEFAULT_PROFILES_FILE``, which only Fast DDS 3
  (Kilted) reads.
* :func:`localhost_only_env`: ``ROS_AUTOMATIC_DISCOVERY_RANGE`` is Iron and later; Humble keeps DDS on the
  machine with ``ROS_LOCALHOST_ONLY=1`` (which Kilted ignores).

The environment half reads version numbers from the installed ``package.xml`` files and imports nothing, so
launch files and ROS-free code can use it; the rclpy half imports rclpy when called.
"""
from __future__ import annotations

import functools
import inspect
import os
import re
import sys

FASTDDS_PROFILE_VARIABLE = "FASTDDS_DEFAULT_PROFILES_FILE"
"""Read by Fast DDS 3 (rmw_fastrtps 9, Kilted and later)."""
FASTRTPS_PROFILE_VARIABLE = "FASTRTPS_DEFAULT_PROFILES_FILE"
"""Read by Fast DDS 2.x (rmw_fastrtps 6 in Humble, 8 in Jazzy)."""
PROFILE_VARIABLES = (FASTDDS_PROFILE_VARIABLE, FASTRTPS_PROFILE_VARIABLE)

# rclpy's major version in each distribution (its package.xml), oldest first.
RCLPY_MAJOR_TO_DISTRO = ((3, "humble"), (4, "iron"), (7, "jazzy"), (9, "kilted"), (10, "rolling"))
FASTDDS3_RMW_MAJOR = 9
"""rmw_fastrtps_cpp's first major version built on Fast DDS 3."""
DISCOVERY_RANGE_DISTROS_FROM = "iron"
"""The first distribution that reads ROS_AUTOMATIC_DISCOVERY_RANGE."""
_DISTROS = [name for _, name in RCLPY_MAJOR_TO_DISTRO]


# ------------------------------------------------------------------ the environment (no imports of ROS)
def _prefixes(environ) -> list[str]:
    paths = [p for p in environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p]
    return paths + [sys.prefix]


def package_version(package: str, environ=None) -> tuple[int, ...] | None:
    """The version of an installed ROS package from ``share/<package>/package.xml`` on ``AMENT_PREFIX_PATH``
    (then this Python's prefix, where the PyPI wheels put it); None where it is not found."""
    environ = os.environ if environ is None else environ
    for prefix in _prefixes(environ):
        path = os.path.join(prefix, "share", package, "package.xml")
        try:
            with open(path, encoding="utf-8") as fh:
                match = re.search(r"<version>\s*(\d+(?:\.\d+)*)\s*</version>", fh.read())
        except OSError:
            continue
        if match:
            return tuple(int(x) for x in match.group(1).split("."))
    return None


def ros_distro(environ=None) -> str | None:
    """The ROS 2 distribution: ``ROS_DISTRO`` (set by a ROS installation's setup script), else the one whose
    rclpy major version is installed (the PyPI wheels set no ROS_DISTRO); None where neither says."""
    environ = os.environ if environ is None else environ
    named = environ.get("ROS_DISTRO", "").strip().lower()
    if named:
        return named
    version = package_version("rclpy", environ)
    if version is None:
        return None
    distro = None
    for major, name in RCLPY_MAJOR_TO_DISTRO:
        if version[0] >= major:
            distro = name
    return distro


def _at_least(distro: str | None, first: str) -> bool | None:
    if distro not in _DISTROS:
        return None
    return _DISTROS.index(distro) >= _DISTROS.index(first)


def fastdds_major(environ=None) -> int | None:
    """Fast DDS's major version (2 or 3) from rmw_fastrtps_cpp's version; None where it is not installed."""
    version = package_version("rmw_fastrtps_cpp", environ)
    if version is None:
        return None
    return 3 if version[0] >= FASTDDS3_RMW_MAJOR else 2


def fastdds_profile_variables(environ=None) -> tuple[str, ...]:
    """The variable(s) to set for Fast DDS to load an XML profile: the one the installed Fast DDS reads, or
    both where its version cannot be told (each version ignores the other's)."""
    major = fastdds_major(environ)
    if major == 3:
        return (FASTDDS_PROFILE_VARIABLE,)
    if major == 2:
        return (FASTRTPS_PROFILE_VARIABLE,)
    return PROFILE_VARIABLES


def profile_already_set(environ) -> str:
    """The profile a user set already, under either variable ('' for none): it is kept, never replaced."""
    for name in PROFILE_VARIABLES:
        if environ.get(name):
            return environ[name]
    return ""


def set_fastdds_profile(environ, path: str) -> None:
    """Set ``path`` as the Fast DDS profile in ``environ`` (a dict) under the variable(s) the installed Fast DDS
    reads, unless a profile is set already (either variable): that one is kept."""
    if profile_already_set(environ):
        return
    for name in fastdds_profile_variables(environ):
        environ[name] = path


def localhost_only_env(environ=None) -> dict:
    """The variables that keep DDS discovery on this machine in the installed distribution:
    ``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST`` from Iron on, ``ROS_LOCALHOST_ONLY=1`` on Humble, both where the
    distribution cannot be told (Iron+ warns that the second is deprecated, Kilted ignores it)."""
    newer = _at_least(ros_distro(environ), DISCOVERY_RANGE_DISTROS_FROM)
    if newer is True:
        return {"ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    if newer is False:
        return {"ROS_LOCALHOST_ONLY": "1"}
    return {"ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST", "ROS_LOCALHOST_ONLY": "1"}


DDS_VARIABLES = ("ROS_AUTOMATIC_DISCOVERY_RANGE", "ROS_LOCALHOST_ONLY", "ROS_DOMAIN_ID", "RMW_IMPLEMENTATION",
                 "AMENT_PREFIX_PATH", *PROFILE_VARIABLES, "ROS_LOG_DIR")
"""The variables that decide which DDS participants a process sees and how (copied into a client process)."""


# ------------------------------------------------------------------ rclpy
def subscription_event_callbacks(**callbacks):
    """``SubscriptionEventCallbacks(**callbacks)`` from ``rclpy.event_handler`` (Iron and later) or
    ``rclpy.qos_event`` (Humble)."""
    try:
        from rclpy.event_handler import SubscriptionEventCallbacks
    except ImportError:  # Humble
        from rclpy.qos_event import SubscriptionEventCallbacks
    return SubscriptionEventCallbacks(**callbacks)


@functools.lru_cache(maxsize=None)
def _takes_wait_for_threads(shutdown) -> bool:
    try:
        return "wait_for_threads" in inspect.signature(shutdown).parameters
    except (TypeError, ValueError):
        return False


def executor_shutdown(executor_class, executor, timeout_sec: float | None = None,
                      wait_for_threads: bool = True) -> bool:
    """``executor_class.shutdown(executor, timeout_sec)`` (the base class's, for a subclass that overrides it),
    passing ``wait_for_threads`` where that rclpy takes it (7.1.12 and later); older ones have no such
    argument and always wait for the executor's threads."""
    shutdown = executor_class.shutdown
    if _takes_wait_for_threads(shutdown):
        return shutdown(executor, timeout_sec, wait_for_threads=wait_for_threads)
    return shutdown(executor, timeout_sec)
