"""The package as a user installs it: the built wheel ships ``py.typed`` (so type checkers
read our hints), installs into a fresh venv, and its metadata describes what it is."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_py_typed_and_installs_into_a_fresh_venv(tmp_path):
    source = tmp_path / "source"  # a copy: the build writes its folders beside the sources
    shutil.copytree(ROOT / "lightning_regions", source / "lightning_regions")
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir"]
    # --no-isolation builds with this venv's setuptools: the test extra pins one that reads
    # pyproject.toml's requirement (a fresh venv of Python 3.11 starts with 65.5).
    built = subprocess.run(
        [*build, str(tmp_path / "dist"), str(source)], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    # our metadata in setuptools' current form: no deprecation warning of the build
    assert "deprecated" not in (built.stdout + built.stderr).lower(), built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("lightning_regions-*.whl")
    assert "lightning_regions/py.typed" in zipfile.ZipFile(wheel).namelist()
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA"))
    )
    assert "License-Expression: Apache-2.0" in metadata.decode()  # SPDX, not a classifier
    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=True)
    python = str(fresh / "bin" / "python")
    install = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, capture_output=True)
    where = "import importlib.util; print(importlib.util.find_spec('lightning_regions').origin)"
    found = subprocess.run([python, "-c", where], cwd=tmp_path, capture_output=True, text=True)
    installed = Path(found.stdout.strip()).parent  # outside the checkout: the installed copy
    assert installed.is_relative_to(fresh) and (installed / "py.typed").is_file()


def test_the_classifiers_describe_the_package():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    classifiers = setup["metadata"]["classifiers"].split()
    text = " ".join(classifiers)
    assert "Pytest" not in text  # it is no pytest plugin
    assert "Typing :: Typed" in setup["metadata"]["classifiers"]
    assert "Programming Language :: Python :: 3.11" in setup["metadata"]["classifiers"]
    assert "License ::" not in text  # deprecated: the SPDX expression says it
    assert setup["metadata"]["license_expression"].strip() == "Apache-2.0"
