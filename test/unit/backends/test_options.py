"""executor.options: every backend reads them into its options dataclass, so a bad option fails at construction
with its field path, and an unknown one with "did you mean"."""
import dataclasses
import importlib
import importlib.util

import pytest

from synflux_ros.backends import EXECUTORS
from synflux_ros.core.config import ConfigError, options_from_dict

# backend -> (an option misspelt, the option meant, a wrongly typed option, the words of its error)
CASES = {
    "mock": ({"latency": {}}, "latency_ms", {"faults": [{"graph": "prefill", "every": "2"}]},
             r"faults\[0\]\.every: expected an integer, got '2'"),
    "onnxruntime": ({"intra_op_threads": 2}, "intra_op_num_threads", {"intra_op_num_threads": "2"},
                    r"intra_op_num_threads: expected an integer, got '2'"),
    "openvino": ({"num_stream": 1}, "num_streams", {"num_streams": 1.5}, r"num_streams: expected an integer"),
    "qnn": ({"soc_modle": 43}, "soc_model", {"soc_model": "SM8550"}, r"soc_model: expected an integer"),
    "rknn": ({"core_mak": "0"}, "core_mask", {"check_toolkit_version": "yes"},
             r"check_toolkit_version: expected true or false, got 'yes'"),
    "tensorrt": ({"cuda_graph": True}, "cuda_graphs", {"dla_core": "0"}, r"dla_core: expected an integer"),
}
NEEDS = {"onnxruntime": "onnxruntime", "openvino": "openvino", "qnn": "onnxruntime_qnn"}


def executor_class(backend):
    if backend in NEEDS and importlib.util.find_spec(NEEDS[backend]) is None:
        pytest.skip(f"{NEEDS[backend]} is not installed")
    module, _, name = EXECUTORS[backend].target.partition(":")
    return getattr(importlib.import_module(module), name)


def test_every_backend_is_covered():
    assert sorted(CASES) == sorted(EXECUTORS)


@pytest.mark.parametrize("backend", sorted(CASES))
def test_an_unknown_option_is_refused_with_its_path_and_the_option_meant(backend):
    cls = executor_class(backend)
    unknown, meant, _, _ = CASES[backend]
    (key,) = unknown
    with pytest.raises(ConfigError, match=rf"^{backend} executor: executor\.options\.{key}: unknown field "
                                          rf"\(choices: .*{meant}.*; did you mean '{meant}'\?\)$"):
        cls([], options=unknown)


@pytest.mark.parametrize("backend", sorted(CASES))
def test_a_wrongly_typed_option_is_refused_with_its_path(backend):
    cls = executor_class(backend)
    _, _, wrong, error = CASES[backend]
    with pytest.raises(ConfigError, match=rf"^{backend} executor: executor\.options\.{error}"):
        cls([], options=wrong)


@pytest.mark.parametrize("backend", sorted(CASES))
def test_options_types_are_frozen_documented_dataclasses(backend):
    options_type = executor_class(backend).options_type
    assert dataclasses.is_dataclass(options_type) and options_type.__dataclass_params__.frozen
    for f in dataclasses.fields(options_type):
        assert f.metadata.get("doc"), f"{options_type.__name__}.{f.name} has no doc"
    defaults = options_type()  # every option has a default: an empty executor.options is valid
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(defaults, dataclasses.fields(options_type)[0].name, None)


def test_the_runtime_latency_key_reaches_only_the_mock():
    mock = executor_class("mock")([], options={"latency_ms": {"prefill": 3}})
    assert mock.latency_ms == {"prefill": 3.0}
    trt = executor_class("tensorrt")
    with pytest.raises(ModuleNotFoundError, match="no_such_trt"):  # got past the options to the import
        trt([], options={"latency_ms": {"prefill": 3}, "module": "no_such_trt"})


def test_options_from_dict_checks_the_mapping_and_prefixes_paths():
    from synflux_ros.backends.rknn.options import RKNNExecutorOptions

    assert options_from_dict(RKNNExecutorOptions, None) == RKNNExecutorOptions()
    assert options_from_dict(RKNNExecutorOptions, {"target": "rk3588"}).target == "rk3588"
    with pytest.raises(ConfigError, match=r"^executor\.options: expected a mapping, got \['rk3588'\]"):
        options_from_dict(RKNNExecutorOptions, ["rk3588"])
    with pytest.raises(ConfigError, match=r"^executor\.placement\.prefill\.options\.runtime: 'npu' is not allowed"):
        options_from_dict(RKNNExecutorOptions, {"runtime": "npu"}, "executor.placement.prefill.options.")
