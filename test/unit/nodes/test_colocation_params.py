"""config/params/colocation.yaml, the params file docs/colocation.md gives: every key a parameter of the node it
names, every value one that node takes (core sets checked as on a machine with the cores it names)."""
import os
from unittest import mock

import yaml

from synflux_ros.core import sharing
from synflux_ros.nodes import vla_node, vlm_node
from synflux_ros.nodes.params import share_dir

PARSERS = {"cpus": sharing.parse_cpus, "command_cpus": sharing.parse_cpus,
           "model_scheduling": sharing.parse_scheduling, "command_scheduling": sharing.parse_scheduling}


def test_the_shipped_colocation_params_are_parameters_the_nodes_take():
    path = os.path.join(share_dir(), "config", "params", "colocation.yaml")
    with open(path, encoding="utf-8") as fh:
        sections = yaml.safe_load(fh)
    nodes = {"/**/vla_node": vla_node.PARAMS, "/**/vlm_node": vlm_node.PARAMS}
    assert set(sections) == set(nodes)
    for key, params in sections.items():
        declared = {p.name for p in nodes[key]}
        values = params["ros__parameters"]
        assert set(values) <= declared, set(values) - declared
        with mock.patch("os.cpu_count", return_value=8):
            for name, value in values.items():
                PARSERS[name](value)
    vla, vlm = (sections[k]["ros__parameters"] for k in ("/**/vla_node", "/**/vlm_node"))
    with mock.patch("os.cpu_count", return_value=8):
        assert not sharing.parse_cpus(vla["cpus"]) & sharing.parse_cpus(vlm["cpus"])  # the cores split
    assert sharing.parse_scheduling(vla["command_scheduling"]).policy == "fifo"
    assert sharing.parse_scheduling(vlm["model_scheduling"]).policy == "idle"
