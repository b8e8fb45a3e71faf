"""Build time only (``synflux-build``): the ONNX exporter and the torch definitions behind the exported
graphs. Needs torch and onnx; nothing a robot runs imports this package."""
