"""What drives the nodes from outside, as processes over DDS: the test harness, the demo and the closed loops
the benchmarks run."""
