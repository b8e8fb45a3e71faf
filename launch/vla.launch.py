"""Start the synflux_ros VLA node: camera frames + instruction in, action chunks out.

Examples:
  ros2 launch synflux_ros vla.launch.py                       # demo config, its executor (mock)
  ros2 launch synflux_ros vla.launch.py image_topic:=/camera/color/image_raw
  ros2 launch synflux_ros vla.launch.py config:=/opt/graphs/pi0/config.yaml namespace:=arm
  ros2 launch synflux_ros vla.launch.py config:=vla_pi0.yaml executor:=onnxruntime \
      graph_dir:=/opt/graphs/pi0
  ros2 launch synflux_ros vla.launch.py publish_joint_trajectory:=true \
      joint_names:='[joint_1, joint_2, joint_3, joint_4, joint_5, joint_6, gripper]'
  ros2 launch synflux_ros vla.launch.py params_file:=/path/to/vla_params.yaml
  ros2 launch synflux_ros vla.launch.py camera_rate_hz:=30      # frames lost in transport are counted
  ros2 launch synflux_ros vla.launch.py fastdds_profile:=none    # keep the environment's Fast DDS settings
  ros2 launch synflux_ros vla.launch.py --show-args           # every argument, described

The arguments are declared in _synflux_launch_common.py, next to this file.
"""

import os
import sys

# Launch files are loaded by path: the module installed next to this file is imported from here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _synflux_launch_common as common  # noqa: E402


def generate_launch_description():
    return common.launch_description(common.VLA_ARGUMENTS, common.vla_actions)
