#!/usr/bin/env bash
# Documentation check and build: docs/benchmarks.md must be what docs/benchmarks/results.jsonl gives, the
# backends' option tables what their options dataclasses give, the rooms and commands of architecture.md what
# the layer test, the modules' docstrings, setup.py and CMakeLists.txt give, and the site must build with
# `mkdocs build --strict` (a broken link, a missing page or a bad anchor fails it).
#
#   bash .ci/docs.sh [PYTHON [PACKAGE_PYTHON]]
#       PYTHON: an interpreter with mkdocs (requirements-docs.txt); default .venv-docs/bin/python
#       PACKAGE_PYTHON: one with the package's dependencies, which reads the options dataclasses from the
#                       source tree; default .venv/bin/python (make venv)
# Set-up once:  python3 -m venv .venv-docs && .venv-docs/bin/pip install -r requirements-docs.txt
# Output: build/site/index.html
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv-docs/bin/python}"
if ! "$PY" -c "import mkdocs" 2>/dev/null; then
  echo "docs: $PY cannot import mkdocs; make the venv first:" >&2
  echo "  python3 -m venv .venv-docs && .venv-docs/bin/pip install -r requirements-docs.txt" >&2
  exit 2
fi
PKG_PY="${2:-.venv/bin/python}"
if ! "$PKG_PY" -c "import numpy, yaml" 2>/dev/null; then
  echo "docs: $PKG_PY cannot import numpy and yaml, which the options tables are read with; run make venv" >&2
  exit 2
fi
"$PY" docs/gen_benchmarks.py --check
"$PKG_PY" docs/gen_backend_options.py --check
"$PY" docs/gen_architecture.py --check
"$PY" -m mkdocs build --strict --clean -f mkdocs.yml -d build/site
echo "docs: built build/site/index.html"
