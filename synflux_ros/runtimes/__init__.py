"""Runtimes: a config turned into a running model (executor, tokenizer, pieces, KV pool), ROS-free.
:class:`~synflux_ros.runtimes.vla.VLARuntime` maps frames to action chunks, and
:class:`~synflux_ros.runtimes.vlm.VLMRuntime` serves multi-turn chat."""
