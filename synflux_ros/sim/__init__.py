"""A robot in simulation for closed-loop runs without hardware: MuJoCo physics, position servos, a headless camera.

ROS-free (numpy and mujoco); ``nodes/sim_robot_node.py`` puts it on ROS topics. mujoco is imported only when a
:class:`.robot.SimRobot` is made, after a headless OpenGL backend has been chosen (:mod:`.gl`). See
docs/simulation.md.
"""
