"""Start the VLA node and the VLM node together (vla.launch.py + vlm.launch.py).

Every argument of the two files is an argument here, once: vla_config/vlm_config and
vla_graph_dir/vlm_graph_dir are handed to the file they name, the VLA topic and trajectory
and camera_rate_hz arguments to vla.launch.py, and executor, params_file, namespace and log_level
to both. The Fast DDS profile (fastdds_profile) is applied here, once, for both nodes.

Examples:
  ros2 launch synflux_ros synflux.launch.py                   # demo configs, mock executor
  ros2 launch synflux_ros synflux.launch.py namespace:=robot1 \
      image_topic:=/camera/color/image_raw vla_config:=vla_pi0.yaml vlm_config:=vlm_qwen3.yaml \
      executor:=onnxruntime vla_graph_dir:=/opt/graphs/pi0 vlm_graph_dir:=/opt/graphs/qwen3
  ros2 launch synflux_ros synflux.launch.py params_file:=/path/to/params.yaml
  ros2 launch synflux_ros synflux.launch.py camera_rate_hz:=30 fastdds_profile:=/path/to/profile.xml
  ros2 launch synflux_ros synflux.launch.py --show-args       # every argument, described
"""

import os
import sys

LAUNCH_DIR = os.path.dirname(os.path.abspath(__file__))

# Launch files are loaded by path: the module installed next to this file is imported from here.
sys.path.insert(0, LAUNCH_DIR)
import _synflux_launch_common as common  # noqa: E402


def generate_launch_description():
    return common.launch_description(common.SYNFLUX_ARGUMENTS, common.synflux_actions, LAUNCH_DIR)
