"""The layout's rules, read off the source. Data flows keypress → UI → Backend → LocalBackend → Engine
(docs/architecture.md); every import must run along that map, never against it: the engine stands alone, the
UI never reaches the engine or torch, and what the front ends share with the engine is its torch-free
vocabulary (tuichat.engine.types, and the cache root in tuichat.engine.storage). And the code passes the
linter, as configured in pyproject.toml."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tuichat"
HEAVY = ("torch", "transformers", "accelerate", "numpy", "gguf", "safetensors")
# What the front ends may know of the engine: its types, and the cache root they share (neither imports torch).
VOCABULARY = ("tuichat.engine", "tuichat.engine.types", "tuichat.engine.storage")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function (absolute names; tuichat uses no relative
    imports, which this also checks)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            # `from tuichat.engine import loader` imports the module tuichat.engine.loader.
            names.update(f"{node.module}.{alias.name}" for alias in node.names if node.module.startswith("tuichat"))
    return names


MODULES = {module_name(path): imported(path) for path in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def existing(name: str) -> bool:
    """A tuichat module (not a name imported from one, like tuichat.engine.types.SamplingParams)."""
    return name in MODULES


def violations(rule) -> list[str]:
    return [f"{module} imports {name}" for module, names in MODULES.items() for name in sorted(names)
            if rule(module, name)]


def test_the_map_finds_the_layers():
    """The rules below see the modules they are about (a rename must not leave them checking nothing)."""
    for module in ("tuichat.engine.engine", "tuichat.engine.types", "tuichat.ui.app", "tuichat.ui.chat",
                   "tuichat.backends.protocol", "tuichat.backends.local", "tuichat.store", "tuichat.cli",
                   "tuichat.engine.prepare", "tuichat.engine.cpu.build", "tuichat.engine.cpu.native"):
        assert module in MODULES, module
    assert "tuichat.engine.engine" in MODULES["tuichat.backends.local"]


def test_the_engine_stands_alone():
    """It imports nothing of the UI, the store, the backends, the catalog or the bench: tuichat/engine alone runs."""
    assert violations(lambda m, n: within(m, "tuichat.engine") and within(n, "tuichat")
                      and not within(n, "tuichat.engine")) == []


def test_the_ui_never_imports_the_engine_or_torch():
    """The UI talks to an engine only through the Backend protocol (tuichat.backends.protocol), and paints before
    torch could have loaded."""
    assert violations(lambda m, n: within(m, "tuichat.ui") and (
        within(n, *HEAVY, "tuichat.engine", "tuichat.backends.local", "tuichat.bench"))) == []


def test_the_shared_modules_know_only_the_engines_vocabulary():
    """The protocol, the store, the config and the catalog are imported by the UI: of the engine they may know
    its types, never its machinery, and nothing heavy."""
    shared = ("tuichat.backends", "tuichat.backends.protocol", "tuichat.store", "tuichat.config", "tuichat.catalog", "tuichat.paths",
              "tuichat.locks", "tuichat.themes", "tuichat.cli", "tuichat.backends.endpoints")
    assert violations(lambda m, n: m in shared and (
        within(n, *HEAVY) or (within(n, "tuichat.engine") and existing(n) and n not in VOCABULARY))) == []


def test_the_remote_side_is_plain_http():
    """A remote engine needs neither torch nor the engine: RemoteBackend and the router run on a machine that only
    talks to a server. The config and the UI read endpoints without importing HTTP."""
    remote = ("tuichat.backends.remote", "tuichat.backends.router")
    assert violations(lambda m, n: m in remote and (
        within(n, *HEAVY) or (within(n, "tuichat.engine") and existing(n) and n not in VOCABULARY))) == []
    assert violations(lambda m, n: within(m, "tuichat.backends.endpoints", "tuichat.config", "tuichat.ui")
                      and within(n, "httpx", "tuichat.backends.remote")) == []


def test_only_the_local_backend_and_the_benchs_peers_reach_into_the_engine():
    """Every front end drives the engine through a Backend; LocalBackend is the one that builds an Engine. The
    bench also loads the model with the engine's loader for transformers' own generate (its peers)."""
    allowed = ("tuichat.engine", "tuichat.backends.local", "tuichat.bench")
    assert violations(lambda m, n: not within(m, *allowed) and within(n, "tuichat.engine") and existing(n)
                      and n not in VOCABULARY) == []


def test_scripts_stand_on_the_package_not_on_the_tests():
    """A script runs from any checkout, installed or not, without the tests on its path: what it shares with
    the tests lives in tuichat."""
    assert [f"{path.name} imports {name}" for path in sorted((ROOT / "scripts").glob("*.py"))
            for name in sorted(imported(path)) if within(name, "tests")] == []


def test_the_architecture_pages_picture_is_the_codes():
    """docs/architecture.md's import graph and module index are generated from the code: a move or a new import
    that is not redrawn fails here, so the picture cannot drift."""
    result = subprocess.run([sys.executable, "scripts/import_map.py", "--check"], cwd=ROOT, capture_output=True,
                            text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_only_the_engine_and_the_local_backend_reach_the_cpu_kernels():
    """The kernels' package (build, bindings, C sources) is the engine's: the engine prepares models with it, and
    LocalBackend asks it only whether a first build is coming (to show progress while it runs)."""
    assert violations(lambda m, n: within(n, "tuichat.engine.cpu") and existing(n)
                      and not within(m, "tuichat.engine", "tuichat.backends.local")) == []


def test_the_c_sources_folder_holds_only_c():
    """csrc/ is what build.py compiles, every .c of it into the one library, and what the wheel ships as data."""
    csrc = PACKAGE / "engine" / "cpu" / "csrc"
    assert sorted(csrc.rglob("*.c")), "build.py compiles nothing"
    assert sorted(str(p.relative_to(csrc)) for p in csrc.rglob("*") if p.is_file() and p.suffix not in (".c", ".h")) == []


def test_the_code_passes_the_linter():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert ruff is not None, "ruff is in the test extras: ./setup.sh installs it"
    result = subprocess.run([ruff, "check", "--no-cache", "tuichat", "tests", "scripts"], cwd=ROOT,
                            capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
