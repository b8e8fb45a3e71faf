"""Start the synflux_ros VLM node: multi-turn chat services backed by a per-session KV cache.

Examples:
  ros2 launch synflux_ros vlm.launch.py                       # demo config, its executor (mock)
  ros2 launch synflux_ros vlm.launch.py config:=/opt/graphs/qwen3/config.yaml namespace:=assistant
  ros2 launch synflux_ros vlm.launch.py config:=vlm_qwen3.yaml executor:=onnxruntime \
      graph_dir:=/opt/graphs/qwen3
  ros2 launch synflux_ros vlm.launch.py params_file:=/path/to/vlm_params.yaml
  ros2 launch synflux_ros vlm.launch.py --show-args           # every argument, described

The arguments are declared in _synflux_launch_common.py, next to this file.
"""

import os
import sys

# Launch files are loaded by path: the module installed next to this file is imported from here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _synflux_launch_common as common  # noqa: E402


def generate_launch_description():
    return common.launch_description(common.VLM_ARGUMENTS, common.vlm_actions)
