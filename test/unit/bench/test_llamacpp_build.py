"""CMAKE_ARGS of `make llamacpp` (synflux_ros/bench/llamacpp_build.py): the host's instruction sets named one
by one, native detection and AMX off."""
from __future__ import annotations

from synflux_ros.bench.llamacpp_build import cmake_args, cpu_flags

SAPPHIRE_RAPIDS = ("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 bmi2 fma f16c avx_vnni avx512f avx512bw "
                   "avx512vbmi avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\nflags\t\t: fpu\n")


def args(text: str, machine: str = "x86_64") -> dict:
    return dict(a[2:].split("=") for a in cmake_args(text, machine).split())


def test_an_amx_cpu_gets_avx512_without_amx_and_no_native_detection():
    got = args(SAPPHIRE_RAPIDS)
    assert got["GGML_NATIVE"] == "OFF"
    assert all(got[k] == "ON" for k in ("GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
                                        "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_AVX_VNNI", "GGML_SSE42"))
    assert got["GGML_AMX_TILE"] == got["GGML_AMX_INT8"] == got["GGML_AMX_BF16"] == "OFF"


def test_a_cpu_without_avx512_gets_it_off():
    got = args("flags : sse4_2 avx avx2 fma f16c bmi2\n")
    assert got["GGML_AVX2"] == "ON" and got["GGML_AVX512"] == "OFF" and got["GGML_AVX512_VNNI"] == "OFF"
    assert got["GGML_AVX_VNNI"] == "OFF"


def test_only_the_first_processor_counts_and_arm_keeps_native_detection():
    assert "amx_tile" in cpu_flags(SAPPHIRE_RAPIDS) and cpu_flags("") == set()
    assert cmake_args("Features : fp asimd", "aarch64") == ""
