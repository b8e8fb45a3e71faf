"""Build time only: what exporting and compiling a graph set is made of, below the backends so that their build
steps (``backends/<name>/build*.py``, ``compile.py``) can use it: the builder base (:mod:`.builder`), the ONNX
export of one graph against its contract (:mod:`.onnx_export`), the seeded inputs of a graph (:mod:`.feeds`)
and the torch definitions behind the exported graphs (:mod:`.torch_models`). Needs torch and onnx; nothing a
robot runs imports this package. The commands built on it (``synflux-build``, ``synflux-validate``) are in
:mod:`synflux_ros.buildtool`."""
