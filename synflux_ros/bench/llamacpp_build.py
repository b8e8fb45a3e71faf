"""CMAKE_ARGS for building llama-cpp-python on this machine: ggml's native detection off, the host's x86
instruction sets (from /proc/cpuinfo) on one by one, and AMX off. A native build on a CPU with AMX crashed on
its first eval; a build from explicit flags without AMX runs. Stdlib only: ``make llamacpp`` runs this file
before the package is installed.

    python synflux_ros/bench/llamacpp_build.py [--cpuinfo FILE]    # prints the CMAKE_ARGS line
"""
from __future__ import annotations

import argparse
import platform

# ggml option -> the /proc/cpuinfo flags that must all be present (ggml/CMakeLists.txt of llama.cpp)
X86_OPTIONS = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f",)),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
)
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor listed in a /proc/cpuinfo text (empty when it lists none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cmake_args(cpuinfo: str, machine: str | None = None) -> str:
    """The CMAKE_ARGS line: ``-DGGML_NATIVE=OFF``, each x86 option ON where the CPU has its flags and OFF
    otherwise, AMX OFF. Off x86 only native detection is left on (the AMX options do not apply there)."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i686", "i386"):
        return ""
    flags = cpu_flags(cpuinfo)
    args = ["-DGGML_NATIVE=OFF"]
    args += [f"-D{opt}={'ON' if all(f in flags for f in need) else 'OFF'}" for opt, need in X86_OPTIONS]
    args += [f"-D{opt}=OFF" for opt in ALWAYS_OFF]
    return " ".join(args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpuinfo", default="/proc/cpuinfo", help="a /proc/cpuinfo text to read the flags from")
    args = ap.parse_args(argv)
    try:
        with open(args.cpuinfo, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        text = ""
    print(cmake_args(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
