from setuptools import find_packages, setup

setup(
    name="megatron-slimpack",
    version="0.1.0",
    description="SlimPack: fine-grained asymmetric packing for variable-length training with Megatron-LM",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_slimpack", "megatron_slimpack.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16,<0.20",
        "ortools>=9.10",
        "numpy",
        "pyyaml",
        "matplotlib",
        "tqdm",
    ],
    extras_require={
        # NVIDIA apex is not on PyPI (the PyPI "apex" is an unrelated package): build it from source
        # if wanted (README, "Running on a GPU cluster"); Megatron falls back to torch without it.
        # flash-attn >= 2.1: before it, causal=True is top-left aligned (wrong for a slice's prefix).
        "gpu": ["transformer-engine[pytorch]", "flash-attn>=2.1"],
        # The real-trainer tests import megatron.training (../shared/megatron-lm), which needs these;
        # triton is imported, unguarded, by megatron-core's inference engine (never called in training).
        # ruff: `make lint` (run first by `make test`), rules in ruff.toml; one minor series, since a
        # new minor release may change what the selected rules report.
        # pytest-xdist: `make test` runs two workers.
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "six", "regex", "pydantic", "IPython",
                 "triton", "ruff>=0.17,<0.18"],
    },
    entry_points={"console_scripts": ["slimpack=megatron_slimpack.cli:main"]},
)
