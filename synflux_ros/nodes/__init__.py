"""The ROS 2 nodes, the only run-time room that imports rclpy: the model nodes, the simulated robot, and the
node code they share."""
