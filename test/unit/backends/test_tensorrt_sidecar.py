"""backends/tensorrt/sidecar.py: the one schema of tensorrt.json, which synflux-build writes and the tensorrt
executor reads; a bad file is refused naming the field."""
import json

import pytest

from synflux_ros.backends import sidecar as common
from synflux_ros.backends.tensorrt import plan, sidecar


def entry(**extra):
    fields = dict(file="llm.engine", onnx="tensorrt/onnx/llm.onnx", kind="llm", profiles=("prefill_8", "decode_16"),
                  key="k1", bytes=1024)
    return sidecar.EngineEntry(**{**fields, **extra})


def good() -> dict:
    return {"format": plan.FORMAT, "tensorrt": "10.3.0", "module": "tensorrt", "sm": "8.7", "dla_core": None,
            "precision": "fp16", "flags": {"precision": "fp16"}, "graph_keys": {"prefill_8": "a"},
            "engines": {"llm": entry(seconds=2.5).to_json()}}


def test_a_written_sidecar_reads_back_as_it_was_and_keeps_its_layout(tmp_path):
    side = sidecar.Sidecar(tensorrt="10.3.0", sm="8.7", precision="fp16", dla_core=0, flags={"precision": "fp16"},
                           graph_keys={"prefill_8": "a"},
                           engines={"llm": entry(seconds=1.25, dla=True,
                                                 dla_fallback_layers=(("attn", "no DLA kernel"),))})
    data = sidecar.write(str(tmp_path), side)
    text = (tmp_path / plan.SIDECAR).read_text()
    # the layout the engine build has always written: keys sorted, one-space indent
    assert text == json.dumps(data, indent=1, sort_keys=True) and data["format"] == "synflux-tensorrt/1"
    assert data["engines"]["llm"]["profiles"] == ["prefill_8", "decode_16"]
    assert data["engines"]["llm"]["dla_fallback_layers"] == [["attn", "no DLA kernel"]]
    assert sidecar.read(str(tmp_path)) == side


def test_optional_fields_read_with_their_defaults():
    data = good()
    data["engines"] = {"llm": {"file": "llm.engine", "profiles": ["prefill_8"]}}
    for name in ("module", "dla_core", "flags", "graph_keys"):
        data.pop(name)
    side = sidecar.Sidecar.from_json(data)
    e = side.engines["llm"]
    assert (e.key, e.bytes, e.seconds, e.dla, e.dla_fallback_layers) == ("", 0, None, False, ())
    assert side.module == "tensorrt" and side.dla_core is None and side.graph_keys == {}


@pytest.mark.parametrize("change,error", [
    ({"format": "synflux-tensorrt/0"}, "not a synflux-tensorrt/1 file"),
    ({"tensorrt": None}, "field 'tensorrt' is missing"),
    ({"sm": 8.7}, "field 'sm' must be a string, got 8.7"),
    ({"dla_core": "0"}, "field 'dla_core' must be an integer or null, got '0'"),
    ({"dla_core": -1}, "field 'dla_core' must be >= 0"),
    ({"graph_keys": {"prefill_8": 3}}, "field 'graph_keys' must map graph names to keys"),
    ({"engines": ["llm"]}, "field 'engines' must be an object"),
    ({"engines": {"llm": 3}}, "engine 'llm': expected an object"),
    ({"engines": {"llm": {"profiles": []}}}, "engine 'llm': field 'file' is missing"),
    ({"engines": {"llm": {"file": "x", "profiles": "prefill_8"}}}, "engine 'llm': field 'profiles' must be a list"),
    ({"engines": {"llm": {"file": "x", "profiles": [1]}}}, "engine 'llm': field 'profiles' must be a list of graph"),
    ({"engines": {"llm": {"file": "x", "profiles": [], "bytes": True}}}, "engine 'llm': field 'bytes' must be an int"),
    ({"engines": {"llm": {"file": "x", "profiles": [], "bytes": -1}}}, "engine 'llm': field 'bytes' must be >= 0"),
    ({"engines": {"llm": {"file": "x", "profiles": [], "dla_fallback_layers": ["a"]}}},
     "engine 'llm': field 'dla_fallback_layers'"),
])
def test_a_bad_sidecar_is_refused_naming_the_field(change, error):
    data = good()
    for k, v in change.items():
        if v is None:
            data.pop(k)
        else:
            data[k] = v
    with pytest.raises(sidecar.SidecarError, match=error) as info:
        sidecar.Sidecar.from_json(data)
    assert isinstance(info.value, common.SidecarError) and isinstance(info.value, ValueError)


def test_missing_and_unreadable_sidecars(tmp_path):
    with pytest.raises(FileNotFoundError):
        sidecar.read(str(tmp_path))
    (tmp_path / plan.SIDECAR).write_text("{not json")
    with pytest.raises(sidecar.SidecarError, match="unreadable"):
        sidecar.read(str(tmp_path))
