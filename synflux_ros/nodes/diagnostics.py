"""``/diagnostics`` messages of the model nodes: building them, reading them back, and the text of ROS strings.

A node publishes one ``DiagnosticStatus`` per period (:func:`diagnostic_array`): a level (:data:`OK`,
:data:`WARN`, :data:`ERROR`), a one-line message and key/value pairs, floats with three decimals.
:func:`subscribe_diagnostics` is the reading side, for the soak run and other clients.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

OK, WARN, ERROR = DiagnosticStatus.OK[0], DiagnosticStatus.WARN[0], DiagnosticStatus.ERROR[0]


def ros_text(text: str) -> str:
    """``text`` as it can travel in a ROS string. ROS strings end at U+0000, so each is sent as U+2400
    (SYMBOL FOR NULL) instead of cutting the text there."""
    return text.replace("\x00", "\u2400")


def median(values) -> float:
    """The median of ``values``, 0.0 for none (a diagnostics value before the first sample)."""
    values = list(values)
    return float(statistics.median(values)) if values else 0.0


def diagnostic_array(node, status_name: str, hardware_id: str, level: int, message: str,
                     values: dict[str, Any]) -> DiagnosticArray:
    """One status stamped with ``node``'s clock; values are sent as strings (floats with three decimals)."""
    arr = DiagnosticArray()
    arr.header.stamp = node.get_clock().now().to_msg()
    st = DiagnosticStatus(level=bytes([level]), name=status_name, message=ros_text(message),
                          hardware_id=hardware_id)
    st.values = [KeyValue(key=k, value=ros_text(f"{v:.3f}" if isinstance(v, float) else str(v)))
                 for k, v in values.items()]
    arr.status = [st]
    return arr


def subscribe_diagnostics(node, callback: Callable[[str, dict[str, str]], None], depth: int = 10):
    """The reading side of :func:`diagnostic_array`: subscribe ``node`` to ``/diagnostics`` and call
    ``callback(status name, {key: value})`` for each status received (values as sent: strings). Returns the
    subscription (destroy it with ``node.destroy_subscription``)."""
    def on_array(msg: DiagnosticArray):
        for st in msg.status:
            callback(st.name, {kv.key: kv.value for kv in st.values})
    return node.create_subscription(DiagnosticArray, "/diagnostics", on_array, depth)
