"""Build time only: the ``synflux-build`` command (:mod:`.export`, with ``--check`` in :mod:`.check`, the GGUF
import and weight quantization) and ``synflux-validate`` (:mod:`.validate`). It sits above the backends: it
chooses a backend's build step or executor from their registry. What those build steps share with it (the
builder base, the ONNX export, the torch models) is in :mod:`synflux_ros.graphkit`. Needs torch and onnx;
nothing a robot runs imports this package."""
