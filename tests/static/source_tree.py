"""The project's source as modules: a file's installed name and back (pyproject's
`package-dir`: `asyncrl.proto` is proto/, `asyncrl.services` is services/), and the modules a
file imports, read from its syntax tree. Shared by the dependency and layer tests."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIRS = {name: ROOT / folder for name, folder in SETUPTOOLS["package-dir"].items()}
NAMESPACE = "asyncrl"
FOLDERS = tuple(path.name for path in PACKAGE_DIRS.values())  # proto, buffer, trainer, services


def module_name(path: Path) -> str:
    """`services/engine/app.py` → `asyncrl.services.engine.app`."""
    path = path.resolve()
    for name, folder in PACKAGE_DIRS.items():
        if path.is_relative_to(folder):
            parts = path.relative_to(folder).with_suffix("").parts
            return ".".join((name, *parts)).removesuffix(".__init__")
    raise ValueError(f"{path} is outside the installed packages")


def source_of(module: str) -> Path | None:
    """The file of one of the project's modules, or None (a name inside a module, not a module)."""
    for name, folder in PACKAGE_DIRS.items():
        if module == name or module.startswith(name + "."):
            path = folder.joinpath(*module.removeprefix(name).lstrip(".").split("."))
            for candidate in (path.with_suffix(".py"), path / "__init__.py"):
                if candidate.is_file():
                    return candidate
    return None


def source_files() -> list[Path]:
    return sorted(path for folder in PACKAGE_DIRS.values() for path in folder.rglob("*.py"))


def imports(path: Path, *, type_checking: bool = False) -> set[str]:
    """Absolute names of every module `path` imports (`from a import b` gives a and a.b), lazy
    imports inside functions included; those under `if TYPE_CHECKING` only if `type_checking`."""
    tree = ast.parse(path.read_text())
    skipped = set()
    if not type_checking:
        skipped = {
            id(sub)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for sub in ast.walk(stmt)
        }
    try:
        module = module_name(path)
    except ValueError:
        module = path.stem
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package[: len(package) - node.level + 1] + ([node.module] if node.module else [])
                )
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names
