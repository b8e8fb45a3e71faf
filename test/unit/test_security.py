"""Untrusted input stays bounded and inert.

* The package's source holds no way to run data as code: no pickle (or its relatives), no eval/exec,
  YAML only through ``yaml.safe_load``, no shell commands.
* Requests are bounded before any work is done on them: a chat prompt by its size in bytes
  (``session.max_prompt_bytes``) before it is tokenised, an image by its pixel count
  (``vision.max_input_pixels``) before it is decoded, read from the header for compressed data.
"""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import synflux_ros
from synflux_ros.core.config import ConfigError, describe_fields, load_config
from synflux_ros.core.config import DEFAULT_MAX_INPUT_PIXELS
from synflux_ros.model.image import ImageError, decode_compressed, decode_raw
from synflux_ros.runtimes.sessions import RequestError
from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime

from images import jpeg_with_size, png_header_only

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config" / "vlm_demo.yaml"

# ------------------------------------------------------------------------------------------ source scan

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
UNSAFE_BUILTINS = {"eval", "exec", "compile"}
SAFE_YAML = {"safe_load", "safe_load_all", "safe_dump", "safe_dump_all", "dump", "dump_all", "YAMLError",
             "SafeLoader", "CSafeLoader", "SafeDumper", "CSafeDumper"}


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""  # a call on a computed value, such as module().eval()
    parts.append(node.id)
    return ".".join(reversed(parts))


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_uses(source: str, filename: str = "<source>") -> list[str]:
    """``line: what`` for each construct that can turn data into code."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            if top in UNSAFE_MODULES:
                found.append(f"{line}: from {node.module} import")
            if top == "yaml":
                found += [f"{line}: from yaml import {a.name}" for a in node.names if a.name not in SAFE_YAML]
        elif isinstance(node, ast.Attribute) and _dotted(node.value) == "yaml" and node.attr not in SAFE_YAML:
            found.append(f"{line}: yaml.{node.attr}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in UNSAFE_BUILTINS or name in {f"builtins.{b}" for b in UNSAFE_BUILTINS}:
                found.append(f"{line}: {name}()")
            elif name.endswith(".load") and name.split(".")[0] in ("np", "numpy") and \
                    _is_true(_keyword(node, "allow_pickle")):
                found.append(f"{line}: {name}(allow_pickle=True)")
            elif name == "torch.load" and not _is_true(_keyword(node, "weights_only")):
                found.append(f"{line}: torch.load without weights_only=True")
            elif name in ("os.system", "os.popen"):
                found.append(f"{line}: {name}()")
            elif name.startswith("subprocess.") and _is_true(_keyword(node, "shell")):
                found.append(f"{line}: {name}(shell=True)")
    return found


def python_sources() -> list[Path]:
    """Every Python file of the installed package, and the repository's launch files and scripts."""
    roots = [Path(synflux_ros.__file__).parent, REPO / "launch", REPO / "scripts"]
    files = [p for root in roots if root.is_dir() for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    files += [p for p in (REPO / "scripts").glob("*") if p.is_file() and p.suffix == "" and
              p.read_bytes().startswith(b"#!") and b"python" in p.read_bytes().split(b"\n", 1)[0]] \
        if (REPO / "scripts").is_dir() else []
    return files


@pytest.mark.parametrize("snippet,what", [
    ("import pickle\npickle.loads(b'')", "import pickle"),
    ("from pickle import loads", "from pickle import"),
    ("import dill", "import dill"),
    ("import yaml\nyaml.load(open('f'))", "yaml.load"),
    ("import yaml\nyaml.load(s, Loader=yaml.SafeLoader)", "yaml.load"),
    ("import yaml\nyaml.unsafe_load(s)", "yaml.unsafe_load"),
    ("import yaml\nyaml.full_load(s)", "yaml.full_load"),
    ("import yaml\nyaml.safe_load(s, Loader=yaml.Loader)", "yaml.Loader"),
    ("from yaml import load", "from yaml import load"),
    ("from yaml import UnsafeLoader", "from yaml import UnsafeLoader"),
    ("eval('1 + 1')", "eval()"),
    ("exec('x = 1')", "exec()"),
    ("import builtins\nbuiltins.exec(code)", "builtins.exec()"),
    ("compile(src, 'f', 'exec')", "compile()"),
    ("import numpy as np\nnp.load(f, allow_pickle=True)", "allow_pickle=True"),
    ("import torch\ntorch.load(f)", "torch.load"),
    ("import os\nos.system('ls')", "os.system()"),
    ("import subprocess\nsubprocess.run('ls', shell=True)", "shell=True"),
])
def test_the_scan_finds_each_unsafe_construct(snippet, what):
    found = unsafe_uses(snippet)
    assert any(what in f for f in found), found


def test_the_scan_leaves_safe_code_alone():
    safe = ("import yaml, numpy as np, subprocess, torch, re\n"
            "yaml.safe_load(s); yaml.safe_dump(d); yaml.YAMLError\n"
            "model.eval(); Model().eval(); re.compile('x'); np.load(f); np.load(f, allow_pickle=False)\n"
            "torch.load(f, weights_only=True); subprocess.run(['ls'], check=True)\n")
    assert unsafe_uses(safe) == []


def test_the_package_source_turns_no_data_into_code():
    files = python_sources()
    assert len(files) > 30 and any(p.parts[-2:] == ("config", "model.py") for p in files)  # sees the package
    problems = [f"{p}:{u}" for p in files for u in unsafe_uses(p.read_text(encoding="utf-8"), str(p))]
    assert not problems, "\n".join(problems)


def test_every_yaml_read_in_the_package_is_safe_load():
    reads = []
    for p in python_sources():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and _dotted(node.func).startswith("yaml.") and \
                    "load" in _dotted(node.func):
                reads.append(_dotted(node.func))
    assert reads and set(reads) == {"yaml.safe_load"}, reads


# ------------------------------------------------------------------------------------------ config limits

def test_the_limits_are_config_fields_with_defaults():
    cfg = load_config(str(CONFIG))
    assert cfg.session.max_prompt_bytes == 64 * 1024
    assert cfg.vision.max_input_pixels == DEFAULT_MAX_INPUT_PIXELS == 4096 * 4096
    described = "\n".join(describe_fields())
    assert "session.max_prompt_bytes (int; 65536; min 1)" in described
    assert f"vision.max_input_pixels (int; {DEFAULT_MAX_INPUT_PIXELS}; min 1)" in described


@pytest.mark.parametrize("section,field,value,needle", [
    ("session", "max_prompt_bytes", 0, "session.max_prompt_bytes: 0 is below the minimum 1"),
    ("session", "max_prompt_bytes", "64k", "session.max_prompt_bytes: expected an integer"),
    ("vision", "max_input_pixels", -1, "vision.max_input_pixels: -1 is below the minimum 1"),
    ("vision", "max_input_pixels", 1.5, "vision.max_input_pixels: expected an integer"),
])
def test_bad_limits_fail_at_load_with_their_path(section, field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(str(CONFIG)).with_overrides(**{section: {field: value}})


def test_the_pixel_limit_shapes_no_graph():
    cfg = load_config(str(CONFIG))
    assert cfg.with_overrides(vision={"max_input_pixels": 640 * 480}).graph_hash() == cfg.graph_hash()


# ------------------------------------------------------------------------------------------ image limits

def test_decode_raw_checks_the_pixel_limit_from_the_fields_alone():
    # data=None would be refused as data; the size is refused first, before the data is looked at
    with pytest.raises(ImageError, match=r"width 100000 x height 100000 = 10000000000 pixels exceeds the limit "
                                         r"of 16777216 pixels \(vision.max_input_pixels\)"):
        decode_raw("rgb8", 100000, 100000, 300000, None)
    data = bytes(range(60))
    assert decode_raw("rgb8", 4, 5, 15, data, max_pixels=20).shape == (4, 5, 3)
    with pytest.raises(ImageError, match="exceeds the limit of 19 pixels"):
        decode_raw("rgb8", 4, 5, 15, data, max_pixels=19)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("data", [png_header_only(5000, 5000), jpeg_with_size(5000, 5000),
                                  png_header_only(60000, 60000), jpeg_with_size(65000, 65000)],
                         ids=["png", "jpeg", "png-bomb", "jpeg-bomb"])
def test_a_compressed_header_beyond_the_pixel_limit_is_refused_before_decoding(data):
    # Each stream holds a few bytes of image data: decoding it would fail as truncated, so the
    # limit's message shows that the size was read from the header and checked first.
    with pytest.raises(ImageError, match="pixels") as err:
        decode_compressed("png", data)
    assert "limit" in str(err.value) and "truncated" not in str(err.value)


def test_decode_compressed_uses_the_callers_limit():
    pil = pytest.importorskip("PIL.Image")
    import io
    buf = io.BytesIO()
    pil.new("RGB", (8, 6)).save(buf, format="PNG")
    assert decode_compressed("png", buf.getvalue(), max_pixels=48).shape == (6, 8, 3)
    with pytest.raises(ImageError, match="width 8 x height 6 = 48 pixels exceeds the limit of 47"):
        decode_compressed("png", buf.getvalue(), max_pixels=47)


# ------------------------------------------------------------------------------------------ chat limits

@pytest.fixture()
def runtime():
    cfg = load_config(str(CONFIG)).with_overrides(session={"max_prompt_bytes": 300},
                                                  vision={"max_input_pixels": 32 * 32})
    rt = VLMRuntime(cfg)
    encoded = []
    encode = rt.tokenizer.encode
    rt.tokenizer.encode = lambda text: encoded.append(text) or encode(text)
    rt.encoded = encoded
    yield rt
    rt.close()


def test_a_prompt_over_the_byte_limit_is_refused_before_tokenising(runtime):
    euro = "\u20ac" * 101  # 101 characters, 303 bytes
    with pytest.raises(RequestError, match=r"prompt has 303 bytes, over the limit of 300 bytes "
                                           r"\(session.max_prompt_bytes\)"):
        runtime.chat(ChatRequest("s", euro))
    with pytest.raises(RequestError, match=r"prompt has 10000000 characters, over the limit of 300 bytes "
                                           r"\(session.max_prompt_bytes\)"):
        runtime.chat(ChatRequest("s", "x" * 10**7))
    assert not any(len(t) > 100 for t in runtime.encoded), "an oversized prompt reached the tokenizer"
    assert runtime.chat(ChatRequest("s", "\u20ac" * 100, max_new_tokens=4)).generated_tokens >= 1


def test_an_image_over_the_pixel_limit_is_refused_before_preprocessing(runtime, monkeypatch):
    seen = []
    features = runtime.vision.features
    monkeypatch.setattr(runtime.vision, "features", lambda img: seen.append(img.shape) or features(img))
    # ten billion pixels that occupy three bytes of memory
    huge = np.lib.stride_tricks.as_strided(np.zeros(3, np.uint8), (100_000, 100_000, 3), strides=(0, 0, 1))
    ok = np.zeros((32, 32, 3), np.uint8)
    with pytest.raises(RequestError, match=r"images\[1\]: width 100000 x height 100000 = 10000000000 pixels "
                                           r"exceeds the limit of 1024 pixels \(vision.max_input_pixels\)"):
        runtime.chat(ChatRequest("s", "look", images=[ok, huge]))
    with pytest.raises(RequestError, match=r"images\[0\]: width 33 x height 32 = 1056 pixels"):
        runtime.chat(ChatRequest("s", "look", images=[np.zeros((32, 33, 3), np.uint8)]))
    assert seen == [], "an image was preprocessed although the request was refused"
    runtime.chat(ChatRequest("s", "look", images=[ok], max_new_tokens=4))
    assert seen == [(32, 32, 3)]


def test_the_cheap_checks_come_before_any_image_is_looked_at(runtime):
    bad = np.zeros((2, 2), np.uint8)
    with pytest.raises(RequestError, match=r"5 images attached, at most 4 per turn"):
        runtime.chat(ChatRequest("s", "look", images=[bad] * 5))
    with pytest.raises(RequestError, match="prompt has 301 characters, over the limit of 300 bytes"):
        runtime.check_limits("s", "x" * 301, 0)
    with pytest.raises(RequestError, match="session_id is not valid Unicode"):
        runtime.check_limits("\ud800", "hi", 0)
    runtime.check_limits("s", "x" * 300, 4)

