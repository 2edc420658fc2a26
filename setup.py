"""Installs stacktools."""

import setuptools


def _requirements(path: str) -> list[str]:
  """The requirement lines of ``path`` (comments and blank lines left out)."""
  with open(path, encoding="utf-8") as f:
    return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


# The range the example's checkpoint code and its tests have passed with.
ORBAX = "orbax-checkpoint>=0.12.8,<0.13"
# The GPT example's --dtype=bfloat16 (Haiku's mixed-precision policies) and
# its tests import jmp themselves; dm-haiku depends on it too, but the
# library never imports it.
JMP = "jmp>=0.0.4"

setuptools.setup(
    name="stacktools",
    version="0.1.0",
    description=("Layer stacking for Haiku and JAX: vmapped init, one scan, "
                 "pluggable checkpoint policies."),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The package and its subpackages (stacktools.remat, stacktools.planner, ...).
    packages=setuptools.find_packages(include=["stacktools", "stacktools.*"]),
    package_data={"stacktools": ["py.typed"]},
    python_requires=">=3.10",
    # The ranges the test suite has passed with. Haiku is in maintenance mode,
    # so its range is the known-good one. JAX's has no upper bound: a cap
    # would move a user's newer jax back, and no release after 0.10.2 is
    # known to break stacktools (a single broken one would be left out with
    # !=). CI (.ci/run) tests both ends: 0.10.2 (.ci/oldest.txt) and the
    # newest on the registry. The two jax 0.12.1 bugs that the example met
    # are avoided there (docs/guides/troubleshooting.md, "Known JAX bugs").
    install_requires=[
        "jax>=0.10.2",
        "jaxlib>=0.10.2",
        "dm-haiku>=0.0.17,<0.0.18",
        "optax>=0.2.5,<0.3",
        "absl-py>=2.0",
        "numpy>=1.26",
    ],
    # Orbax saves and restores the GPT example's checkpoints; the library
    # itself never imports it. No TensorFlow comes with it.
    extras_require={
        "examples": [ORBAX, JMP, "matplotlib>=3.7"],
        "test": ["pytest>=8", ORBAX, JMP],
        "plot": ["matplotlib>=3.7"],
        # The docs site (mkdocs.yml): `mkdocs build --strict`, `mkdocs serve`.
        "docs": _requirements("docs/requirements.txt"),
    },
)
