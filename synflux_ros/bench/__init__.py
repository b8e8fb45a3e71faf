"""Benchmarks: ``llm`` (synflux-bench: decode speed, memory and time to first token against transformers
and onnxruntime-genai) and ``nodes`` (latency and throughput of the running ROS nodes)."""
