"""pip installation of the ROS-free parts (core, runtimes, synflux-build, synflux-bench) on a workstation.

On a robot the package is built with colcon (package.xml declares ament_cmake, which also generates the
ROS interfaces); colcon does not use this file. Do not pip-install it into an environment that holds a
CMake/colcon install of synflux_ros: pip would remove the generated message modules.
"""
from setuptools import find_packages, setup

setup(
    name="synflux_ros",
    version="0.1.0",
    description="VLA and VLM models on the robot's own accelerator: static graph sets, executors, runtimes",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["synflux_ros", "synflux_ros.*"]),
    package_data={"synflux_ros": []},
    install_requires=["numpy", "pyyaml", "pillow", "jinja2>=3.1.6"],
    extras_require={
        "tokenizers": ["tokenizers"],
        "onnxruntime": ["onnxruntime"],
        # Export needs torch; install the build of torch that fits the machine first (CPU is enough).
        "build": ["torch", "onnx", "safetensors", "transformers>=5"],
        "bench": ["onnxruntime-genai"],
    },
    entry_points={"console_scripts": [
        "synflux-build=synflux_ros.buildtool.export:main",
        "synflux-bench=synflux_ros.bench.llm:main",
        "synflux-validate=synflux_ros.buildtool.validate:main",
        "synflux-serve=synflux_ros.serve.cli:main",
    ]},
)
