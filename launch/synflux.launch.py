"""Start the VLA node and the VLM node together (vla.launch.py + vlm.launch.py).

Every argument of the two files is an argument here, once: vla_config/vlm_config and
vla_graph_dir/vlm_graph_dir are handed to the file they name, the VLA topic and trajectory
arguments to vla.launch.py, and executor, params_file, namespace, log_level and fastdds_profile
to both.

Examples:
  ros2 launch synflux_ros synflux.launch.py                   # demo configs, mock executor
  ros2 launch synflux_ros synflux.launch.py namespace:=robot1 \
      image_topic:=/camera/color/image_raw vla_config:=vla_pi0.yaml vlm_config:=vlm_qwen3.yaml \
      executor:=onnxruntime vla_graph_dir:=/opt/graphs/pi0 vlm_graph_dir:=/opt/graphs/qwen3
  ros2 launch synflux_ros synflux.launch.py params_file:=/path/to/params.yaml
  ros2 launch synflux_ros synflux.launch.py --show-args       # every argument, described
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
    return common.launch_description(common.SYNFLUX_ARGUMENTS, common.synflux_actions, LAUNCH_DIR)
