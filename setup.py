"""The package list, found rather than written down, so that a new subpackage is never left
out of a wheel (``tests/test_wheel.py`` builds one and checks).

Everything else is in ``pyproject.toml``. ``cost_models/`` and ``passes/`` sit at the top of
the repository but install as ``autopar.cost_models`` and ``autopar.passes`` (setuptools
``package_dir``), so that installing autopar never puts a module named ``passes`` on anyone's
path. A development checkout may also hold ``autopar/cost_models`` and ``autopar/passes`` as
links to those folders; they are skipped here, the mapped folders are searched instead.
"""
from setuptools import find_packages, setup

MAPPED = {"autopar.cost_models": "cost_models", "autopar.passes": "passes"}
"""installed package name -> the repository folder that holds it"""


def _is_mapped(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in MAPPED)


def packages() -> list[str]:
    """Every folder with an ``__init__.py`` under autopar/, cost_models/ and passes/, by the
    name it installs under."""
    found = [p for p in find_packages(include=["autopar", "autopar.*"]) if not _is_mapped(p)]
    for name, folder in MAPPED.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return sorted(found)


setup(packages=packages(), package_dir=MAPPED)
