"""The wheel ``pip install .`` builds holds all of autopar and runs without the source tree.

One wheel is built per module (``pip wheel --no-deps --no-build-isolation``: no network,
setuptools from this venv) from a copy of the packaging files and package folders, so no
``build/`` folder is left in the repository. Then:

- every file under ``autopar/``, ``cost_models/`` and ``passes/`` (modules and the data
  they read at run time, such as ``autopar/hf_configs/*.json``) is in the wheel, under
  ``autopar/``, ``autopar/cost_models/`` and ``autopar/passes/``; nothing else is at its top
  level (no module named ``passes`` on a user's path);
- the wheel unpacked alone on ``PYTHONPATH``, run from an empty folder, imports autopar,
  its passes and cost models, finds the shipped configs and the demo's model, and plans an
  ``nn.Linear`` for ``2x8xA100``, with every module read from the wheel.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = {"autopar": "autopar", "cost_models": "autopar/cost_models",
                   "passes": "autopar/passes"}
"""repository folder -> where its files install"""
PACKAGING_FILES = ("pyproject.toml", "setup.py")


def _source_files(folder: str) -> list[Path]:
    """The files of a package folder that ship: all but bytecode, and without following the
    ``autopar/cost_models`` and ``autopar/passes`` links a development checkout may hold
    (those folders are counted under their own names)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT / folder):   # followlinks=False
        dirnames[:] = [d for d in dirnames if d != "__pycache__"
                       and not (Path(dirpath) / d).is_symlink()]
        out += [Path(dirpath, f) for f in filenames if not f.endswith((".pyc", ".pyo"))]
    return out


def _expected_names() -> set[str]:
    """Each source file's name inside the wheel."""
    return {f"{dest}/{p.relative_to(ROOT / src).as_posix()}"
            for src, dest in PACKAGE_FOLDERS.items() for p in _source_files(src)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    import setuptools
    major_minor = tuple(int(n) for n in setuptools.__version__.split(".")[:2])
    assert major_minor >= (70, 1), (
        f"setuptools {setuptools.__version__} in {sys.prefix} cannot build a wheel without the "
        "`wheel` package: pip install 'setuptools>=70.1' (the dev extra pins it)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for f in PACKAGING_FILES:
        shutil.copy2(ROOT / f, src / f)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, symlinks=True, ignore=skip)
    dist = tmp / "dist"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=180, cwd=tmp)
    assert res.returncode == 0, f"pip wheel failed:\n{res.stdout}\n{res.stderr}"
    wheels = list(dist.glob("autopar-*.whl"))
    assert len(wheels) == 1, f"expected one autopar wheel in {dist}, found {wheels}"
    return wheels[0]


def test_every_module_and_data_file_is_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _expected_names()
    # the lists are not empty by accident: the packages, both mapped folders and the configs
    for must in ("autopar/__init__.py", "autopar/cli.py", "autopar/nanogpt.py",
                 "autopar/cost_models/__init__.py", "autopar/passes/__init__.py",
                 "autopar/sharding/rules/__init__.py", "autopar/hf_configs/gpt2.json"):
        assert must in expected, f"{must} is not in the source tree any more: update this test"
    missing = sorted(expected - names)
    assert not missing, (f"{len(missing)} source files are not in the wheel: {missing[:20]}; "
                         "a folder without __init__.py is not found by setup.py's "
                         "find_packages, and data files need [tool.setuptools.package-data]")
    tops = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"autopar"}, f"the wheel installs more than autopar: {sorted(tops)}"
    extra = sorted(n for n in names - expected if n.split("/", 1)[0] not in dist_info)
    assert not extra, f"the wheel holds files the source tree does not: {extra[:20]}"
    (info,) = dist_info
    entry_points = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "autopar = autopar.cli:main" in entry_points, entry_points


# Run in a fresh interpreter whose only source of autopar is the unpacked wheel.
_PROBE = textwrap.dedent("""
    import importlib.util, json, sys
    from pathlib import Path
    site = Path(sys.argv[1]).resolve()
    import torch
    import autopar, autopar.passes, autopar.cost_models
    from autopar import hf_models
    from autopar.cli import DEMO_FACTORY
    from autopar.cli_args import build_example
    # the demo's model and the shipped configs come from the package, not the source tree
    demo = build_example(DEMO_FACTORY, {"batch": 8})
    demo_module = sys.modules[type(demo.model).__module__]
    read_from = {m.__name__: str(Path(m.__file__).resolve())
                 for m in (autopar, autopar.passes, autopar.cost_models, hf_models, demo_module)}
    name, cfg = hf_models.load_config("gpt2")
    model = torch.nn.Linear(16, 16)
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    plan = autopar.plan(model, (x,), torch.nn.functional.mse_loss, target=y,
                        cluster="2x8xA100", time_limit_s=30)
    print(json.dumps({
        "site": str(site), "read_from": read_from,
        "examples_importable": importlib.util.find_spec("examples") is not None,
        "demo_factory": DEMO_FACTORY,
        "shipped": hf_models.shipped(), "gpt2_layers": cfg["n_layer"],
        "demo_params": sum(p.numel() for p in demo.model.parameters()),
        "demo_loss": demo.loss_fn(demo.model(*demo.inputs), demo.target).item(),
        "world_size": plan.world_size, "cluster": plan.cluster,
        "step_time_s": plan.estimate.step_time_s}))
""")


def test_the_unpacked_wheel_imports_and_plans_without_the_source_tree(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    res = subprocess.run([sys.executable, "-c", _PROBE, str(site)], cwd=empty, env=env,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, f"the unpacked wheel failed:\n{res.stdout}\n{res.stderr[-4000:]}"
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for module, path in got["read_from"].items():
        assert Path(path).is_relative_to(site.resolve()), f"{module} was read from {path}, not the wheel"
    assert not got["examples_importable"], "the source tree's examples/ is on the probe's path"
    assert "gpt2" in got["shipped"] and len(got["shipped"]) == len(
        list((ROOT / "autopar" / "hf_configs").glob("*.json")))
    assert got["gpt2_layers"] == 12                       # GPT-2 small: 12 layers
    assert got["demo_factory"].startswith("autopar."), got["demo_factory"]
    # the demo's GPT is the examples' tiny GPT: the same parameters and the same first loss
    from examples.gpt import gpt_factory
    ex = gpt_factory(batch=8)
    assert got["demo_params"] == sum(p.numel() for p in ex.model.parameters())
    assert got["demo_loss"] == ex.loss_fn(ex.model(*ex.inputs), ex.target).item()
    assert got["world_size"] == 16 and got["cluster"] == "2x8xA100"
    assert got["step_time_s"] > 0
