#!/usr/bin/env bash
# The Python 3.10 lane: the robot's run-time suite in the world of ROS 2 Humble on Jetson Orin / Ubuntu 22.04.
#
#   bash .ci/lane-py310.sh            (from the repository root; a Makefile target calls it so)
#
# - .venv-py310/: Python 3.10 (scripts/find_python.sh 3.10) with requirements-ros.txt (Jazzy's PyPI wheels,
#   which have cp310 builds; there is no Humble rclpy wheel), numpy held at 1.26.4 (Humble's numpy 1.x), the
#   newest onnxruntime with a cp310 wheel, onnx (the backend tests make their graphs with it), openvino and
#   scipy (a reference in one test); NO torch, transformers, Ray or MuJoCo: a robot runs torch-free. A stamp
#   (.venv-py310/.stamp-lane) holds the hash of what went in; a second run with the same inputs skips the install.
# - the package configured, built and installed into that venv prefix as `make install` does for .venv, in a
#   build directory of its own (build/py310).
# - pytest from test/ over the run-time selection below (LANE_TESTS), at nice 5, on a DDS domain of its own
#   (the caller's ROS_DOMAIN_ID, or a random base, moved by 50 so that it is not the main run's) on loopback.
#
# Environment: PYTHON310=/path/to/python3.10 overrides the search; LANE_PYTEST_ARGS adds pytest arguments
# (e.g. "-x" or "-k wire"); a non-empty LANE_TESTS replaces the selection.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

VENV=$ROOT/.venv-py310
PY=$VENV/bin/python
BUILD=$ROOT/build/py310
STAMP=$VENV/.stamp-lane

# onnxruntime 1.23.2 is the last release with cp310 wheels (1.24 on are cp311+); onnx (the backend tests make
# their graphs with it), openvino and scipy (test_fast.py's reference DCT) still ship cp310 wheels and float.
# Everything is installed with numpy==1.26.4 as a constraint.
LANE_CONSTRAINTS="numpy==1.26.4"
LANE_PACKAGES="onnxruntime==1.23.2 onnx openvino scipy"

# The run-time suite of a torch-free robot (paths relative to test/): the ROS-free core, the model code, the
# runtimes (remote executor and openpi wire format included), the node helpers, the backends a robot loads
# (mock, onnxruntime, openvino, the rknn/tensorrt run-time parts), the nodes started as processes on the mock
# executor, and the launch-file checks. Left out, and why:
#   unit/graphkit, unit/buildtool, unit/backends/test_{onnxruntime_fusions,tensorrt_build_onnx,tensorrt_executor}.py,
#     unit/bench/test_{quality,peer,llamacpp_build}.py: graph export, quantization, the engine builders and the
#     LLM benchmarks' peers are build-machine code (torch, transformers, onnxscript, TensorRT-RTX, llama.cpp).
#   unit/backends/test_qnn_weights.py: the qnn backend needs onnxruntime-qnn, which has no cp310 wheel (and
#     its test graph takes onnx's default IR version, 14 with onnx 1.23, which onnxruntime 1.23 cannot read).
#   unit/sim, integration/test_sim_*: MuJoCo (mujoco 4.0.0 is cp311+).
#   unit/serve, integration/test_serve_*: synflux-serve runs on the serving machine (Ray Serve); the robot's
#     side of it (executor.backend remote, the wire format) is in unit/runtimes.
#   integration/test_{onnxruntime_nodes,every_config_backends,validate,build_check,tensorrt_build,bench_backends,
#     bench_llm,bench_gguf}.py, parity/, quality/, simulators/: they need graph sets exported by synflux-build
#     (torch), a reference (transformers, LeRobot) or a vendor toolchain (QNN, RKNN, TensorRT); their cases in
#     the files below skip with the reason.
#   integration/test_concurrency_chat.py: nothing of Python 3.10 in it, and its eight-caller case loses a
#     Chat response (60 s timeout) on Python 3.12 as on 3.10 when the machine is loaded; the main run has it.
#   gpu/: a CUDA device. launch/: launch_testing, which has no PyPI wheel; the launch files are checked by
#     integration/test_launch_files.py instead.
LANE_TESTS_DEFAULT="
  unit/test_layers.py unit/test_security.py unit/test_ros_api_surface.py
  unit/core unit/graphset unit/model unit/nodes unit/runtimes unit/execution
  unit/backends/test_mock.py unit/backends/test_options.py unit/backends/test_onnxruntime.py
  unit/backends/test_openvino.py unit/backends/test_rknn_sidecar.py unit/backends/test_tensorrt_plan.py
  unit/backends/test_tensorrt_sidecar.py
  unit/bench/test_control.py unit/bench/test_dds_transport.py
  integration/test_launch_files.py
  integration/test_vla_node.py integration/test_vlm_node.py integration/test_robot_state_node.py
  integration/test_vla_execution.py integration/test_cameras_node.py integration/test_call_service.py
  integration/test_fuzz_chat_service.py integration/test_faults.py
  integration/test_security_limits.py integration/test_shutdown.py integration/test_backend_plugin.py
  integration/test_test_domain.py
  integration/test_humble_shape.py integration/test_dds_profile.py integration/test_base_requirements.py
"
LANE_TESTS=${LANE_TESTS:-$LANE_TESTS_DEFAULT}

now() { date +%s; }

# ---------------------------------------------------------------------------------------------- the venv
PYTHON310=${PYTHON310:-$(scripts/find_python.sh 3.10 || true)}
if [ -z "$PYTHON310" ]; then
  echo "lane-py310: Python 3.10 not found: apt install python3.10-venv (Ubuntu 22.04), pyenv install 3.10," \
       "or PYTHON310=/path/to/python3.10" >&2
  exit 1
fi
# What the venv is made of: the interpreter, the requirements and the lane's own lines.
want=$( { "$PYTHON310" -c 'import sys; print(sys.version)'; cat requirements-ros.txt;
          echo "$LANE_CONSTRAINTS"; echo "$LANE_PACKAGES"; } | sha256sum | cut -d' ' -f1)
t0=$(now)
if [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "lane-py310: .venv-py310 is up to date (requirements unchanged)"
else
  echo "lane-py310: making .venv-py310 with $PYTHON310"
  rm -rf "$VENV"
  "$PYTHON310" -m venv "$VENV"
  printf '%s\n' $LANE_CONSTRAINTS > "$VENV/lane-constraints.txt"
  # pip's log in a file (its warnings about this machine's local indexes are noise), its tail on failure
  pip_log=$VENV/pip-install.log
  { "$PY" -m pip install --upgrade "pip>=23" &&
    "$PY" -m pip install -c "$VENV/lane-constraints.txt" -r requirements-ros.txt $LANE_PACKAGES; } \
    > "$pip_log" 2>&1 || { tail -40 "$pip_log"; echo "lane-py310: pip install failed ($pip_log)" >&2; exit 1; }
  # The lane's premises, checked rather than assumed.
  "$PY" - <<'EOF'
import importlib.util, sys
import numpy, onnxruntime, rclpy  # noqa: F401
assert sys.version_info[:2] == (3, 10), sys.version
assert numpy.__version__ == "1.26.4", numpy.__version__
for name in ("torch", "transformers", "ray", "mujoco"):
    assert importlib.util.find_spec(name) is None, f"{name} must not be in the robot lane"
print(f"lane-py310: python {sys.version.split()[0]}, numpy {numpy.__version__}, onnxruntime {onnxruntime.__version__}")
EOF
  echo "$want" > "$STAMP"
fi
t1=$(now)

# ------------------------------------------------------------------ the package, as `make install` does it
export AMENT_PREFIX_PATH=$VENV
export CMAKE_PREFIX_PATH=$VENV
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
mkdir -p "$BUILD"
LOG=$BUILD/synflux-cmake.log
cmake -S . -B "$BUILD" -DCMAKE_INSTALL_PREFIX="$VENV" -DBUILD_TESTING=OFF \
      -DPython3_EXECUTABLE="$PY" -DCMAKE_BUILD_TYPE=Release > "$LOG" 2>&1 || { tail -40 "$LOG"; exit 1; }
cmake --build "$BUILD" -j2 >> "$LOG" 2>&1 || { tail -40 "$LOG"; exit 1; }
# The Python sources are installed anew (msg/ and srv/ are the generated interfaces and stay).
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
find "$SITE/synflux_ros" -mindepth 1 -maxdepth 1 -type d ! -name msg ! -name srv -exec rm -rf {} + 2>/dev/null || true
cmake --install "$BUILD" >> "$LOG" 2>&1 || { tail -40 "$LOG"; exit 1; }
t2=$(now)

# ------------------------------------------------------------------------------------------------ the tests
base=${ROS_DOMAIN_ID:-$(( RANDOM % 100 + 1 ))}
export ROS_DOMAIN_ID=$(( (base + 50) % 101 + 1 ))
echo "lane-py310: pytest on ROS_DOMAIN_ID=$ROS_DOMAIN_ID"
set +e
# shellcheck disable=SC2086
(cd test && nice -n 5 "$PY" -m pytest -q -rs -p no:cacheprovider --durations=15 --durations-min=5 \
   --basetemp="$BUILD/pytest-py310" ${LANE_PYTEST_ARGS:-} $LANE_TESTS)
rc=$?
set -e
t3=$(now)
echo "lane-py310: venv $((t1 - t0)) s, build+install $((t2 - t1)) s, pytest $((t3 - t2)) s; pytest exit $rc"
exit $rc
