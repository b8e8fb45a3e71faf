"""Start vla_node and vlm_node with the VLM as the VLA's planner.

Every planner_period seconds (2 by default) vlm_node asks its model for the next subtask towards the goal,
with the latest frame on image_topic, and publishes it on instruction_topic, which vla_node follows. The goal
comes from the goal argument, then from goal_topic (std_msgs/String). The other arguments are those of
synflux.launch.py; the planner's are described in docs/ros-interfaces.md ("Planner mode").

Examples:
  ros2 launch synflux_ros planner.launch.py goal:='put the cups in the sink'   # demo configs, mock executor
  ros2 launch synflux_ros planner.launch.py namespace:=robot1 image_topic:=/camera/color/image_raw \
      vla_config:=vla_pi0.yaml vlm_config:=vlm_qwen3.yaml executor:=onnxruntime \
      vla_graph_dir:=/opt/graphs/pi0 vlm_graph_dir:=/opt/graphs/qwen3 planner_period:=5
  ros2 topic pub --once /goal std_msgs/msg/String "{data: 'clear the table'}"   # a new goal
  ros2 launch synflux_ros planner.launch.py --show-args       # every argument, described

The arguments are declared in _synflux_launch_common.py, next to this file.
"""

import os
import sys

# Launch files are loaded by path: the module installed next to this file is imported from here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _synflux_launch_common as common  # noqa: E402


def generate_launch_description():
    return common.launch_description(common.PLANNER_ARGUMENTS, common.planner_actions)
