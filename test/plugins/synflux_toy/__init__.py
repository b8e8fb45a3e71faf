"""A backend registered from outside synflux_ros, through the entry points of synflux_toy-0.1.dist-info:
its build step writes ``toy.json`` beside the graph set and its executor (the mock's computation) refuses a
graph set without it, so a test sees both registry tables at work."""
