"""Chunk execution on the robot's clock, ROS-free: the plan and its merge modes, the joint limiter, whole-chunk
validation, the controller with its watchdog, and the robot-state buffers (docs/execution.md)."""
