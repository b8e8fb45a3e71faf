"""synflux_ros: VLA and VLM models on the robot's own accelerator, as a ROS 2 package."""

__version__ = "0.1.0"
