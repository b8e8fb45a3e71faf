"""Measuring tools: ``llm`` (synflux-bench: decode speed, memory and time to first token against
transformers and onnxruntime-genai), ``nodes`` (latency and throughput of the running ROS nodes),
``soak`` (hours of frames through vla_node: accounting, memory, latency) and ``validate``
(synflux-validate: a backend's outputs against a reference backend's)."""
