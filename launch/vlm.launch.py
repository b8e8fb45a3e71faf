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

import importlib.util
import os

LAUNCH_DIR = os.path.dirname(os.path.abspath(__file__))


def _common():
    path = os.path.join(LAUNCH_DIR, '_synflux_launch_common.py')
    spec = importlib.util.spec_from_file_location('_synflux_launch_common', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate_launch_description():
    common = _common()
    return common.launch_description(common.VLM_ARGUMENTS, common.vlm_actions)
