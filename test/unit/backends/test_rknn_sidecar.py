"""backends/rknn/sidecar.py: the one schema of rknn.json, which synflux-build writes and the rknn executor reads."""
import json

import pytest

from synflux_ros.backends.rknn import sidecar


def entry(name, **extra):
    return sidecar.GraphEntry(file=f"{name}.rknn", source=f"{name}.onnx", key="k1", onnx_key="o1",
                              inputs=(("input_ids", (1, 1)), ("past_kv.0.0", (2, 8, 4))), outputs=("logits",),
                              **extra)


def test_a_written_sidecar_reads_back_as_it_was(tmp_path):
    quant = sidecar.Quantization(dataset="calib/vision_encoder/dataset.txt", samples=4, calib_sha256="ab",
                                 calib_source="generated")
    graphs = {"decode_8": entry("decode_8", seconds=1.5),
              "vision_encoder": entry("vision_encoder", dtype="int8", quantization=quant)}
    (tmp_path / "rknn" / "rk3588").mkdir(parents=True)
    data = sidecar.write(str(tmp_path), sidecar.Sidecar(target="rk3588", toolkit="2.5.0", graphs=graphs,
                                                        quantize="int8:vision_encoder", config_hash="c"))
    on_disk = json.loads((tmp_path / "rknn" / "rk3588" / "rknn.json").read_text())
    assert on_disk == data and data["format"] == "synflux-rknn/1" and data["dtype"] == "int8" and data["written"]
    assert on_disk["graphs"]["decode_8"]["inputs"] == [["input_ids", [1, 1]], ["past_kv.0.0", [2, 8, 4]]]
    assert "quantization" not in on_disk["graphs"]["decode_8"]
    assert on_disk["graphs"]["vision_encoder"]["quantization"]["dtype"] == "w8a8"
    back = sidecar.read(str(tmp_path), "rk3588")
    assert back.graphs == graphs and back.toolkit == "2.5.0" and back.quantize == "int8:vision_encoder"
    assert sidecar.compiled_targets(str(tmp_path)) == ["rk3588"]


def test_an_entry_without_optional_fields_reads_with_their_defaults():
    side = sidecar.Sidecar.from_json({"format": "synflux-rknn/1", "target": "rk3576", "toolkit": "2.5.0",
                                      "graphs": {"g": {"file": "g.rknn", "source": "g.onnx", "key": "k",
                                                       "onnx_key": "o", "inputs": [["x", [1, 2]]],
                                                       "outputs": ["y"]}}}, "rk3576")
    g = side.graphs["g"]
    assert g.dtype == "fp16" and g.quantization is None and g.inputs == (("x", (1, 2)),) and side.dtype == "fp16"
    assert side.quantize == "fp16"


@pytest.mark.parametrize("data,error", [
    ({"format": "synflux-rknn/0", "target": "rk3588"}, "not a synflux-rknn/1 description for rk3588"),
    ({"format": "synflux-rknn/1", "target": "rk3576"}, "not a synflux-rknn/1 description for rk3588"),
    ({"format": "synflux-rknn/1", "target": "rk3588", "dtype": "int4"}, "dtype 'int4' is not supported"),
    ({"format": "synflux-rknn/1", "target": "rk3588", "graphs": ["g"]}, "'graphs' must be an object"),
    ({"format": "synflux-rknn/1", "target": "rk3588", "graphs": {"g": 3}}, "graph 'g': expected an object"),
    ({"format": "synflux-rknn/1", "target": "rk3588", "graphs": {"g": {"inputs": [["x", ["a"]]]}}}, "graph 'g'"),
])
def test_a_sidecar_of_another_kind_is_refused(data, error):
    with pytest.raises(sidecar.SidecarError, match=error):
        sidecar.Sidecar.from_json(data, "rk3588")


def test_missing_and_unreadable_sidecars(tmp_path):
    with pytest.raises(FileNotFoundError):
        sidecar.read(str(tmp_path), "rk3588")
    assert sidecar.compiled_targets(str(tmp_path)) == []
    (tmp_path / "rknn" / "rk3588").mkdir(parents=True)
    (tmp_path / "rknn" / "rk3588" / "rknn.json").write_text("{")
    with pytest.raises(sidecar.SidecarError, match="unreadable"):
        sidecar.read(str(tmp_path), "rk3588")
