"""The layers of the tree, and the names it installs.

proto ← shared runtime ← buffer ← transport ← processes ← operator tools: a module imports only
from its own layer and the layers below it, and no process imports another process's code
(docs/architecture.md §2, docs/CONTRIBUTING.md). Imports are read from the source, lazy ones
and those under `if TYPE_CHECKING` included, and so are modules named in strings (what
`importlib` may load): a design dependency is one whether or not it runs. The one way a process
runs another's code is a declared entry point against an interface in proto/ (`SEAMS`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from source_tree import (
    FOLDERS,
    NAMESPACE,
    PACKAGE_DIRS,
    ROOT,
    SETUPTOOLS,
    imports,
    module_name,
    source_files,
    source_of,
)

# (prefix, layer, process): the longest prefix names a module's place.
PLACES = [
    ("asyncrl.proto", 0, None),
    ("asyncrl.services.runtime", 1, None),
    ("asyncrl.buffer", 2, None),
    ("asyncrl.services.transport", 3, None),
    ("asyncrl.trainer", 4, "trainer"),
    ("asyncrl.services.engine", 4, "engine"),
    ("asyncrl.services.rollout", 4, "rollout"),
    ("asyncrl.services.reward", 4, "reward"),
    # The Tinker-compatible service hosts the trainer's model in process (trainer/tinker): one
    # process with the trainer, so it may import the trainer's code and no other process's.
    ("asyncrl.services.tinker", 4, "trainer"),
    ("asyncrl.services.ops", 5, None),
    ("asyncrl.services", 0, None),  # the package's own __init__: empty
]
LAYER_NAMES = ["proto", "shared runtime", "buffer", "transport", "a process", "operator tools"]


def place(module: str) -> tuple[int, str | None]:
    for prefix, layer, process in PLACES:
        if module == prefix or module.startswith(prefix + "."):
            return layer, process
    raise AssertionError(f"{module} has no place in the layers: add its folder to PLACES")


def own_modules(names: set[str]) -> set[str]:
    """The project's modules among imported names (`from a import b` also gives a.b, which is
    only a module if a file says so: a name inside a module counts as its module)."""
    found = set()
    for name in names:
        if name != NAMESPACE and not name.startswith(NAMESPACE + "."):
            continue
        parts = name.split(".")
        while parts and source_of(".".join(parts)) is None:
            parts.pop()
        if parts:
            found.add(".".join(parts))
    return found


def strings(path: Path) -> set[str]:
    """The string constants of a file, docstrings aside."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }


def named_modules(path: Path) -> set[str]:
    """The project's modules a file names in strings: what it may import by name
    (`importlib.import_module`, a `"module:attr"` registry)."""
    return own_modules({s.partition(":")[0] for s in strings(path) if MODULE_STRING.fullmatch(s)})


MODULE_STRING = re.compile(rf"{NAMESPACE}(\.\w+)+(:\w+)?")


def violations() -> set[tuple[str, str]]:
    broken = set()
    for path in source_files():
        module = module_name(path)
        layer, process = place(module)
        for target in own_modules(imports(path, type_checking=True)) | named_modules(path):
            target_layer, target_process = place(target)
            if target_layer > layer or (process and target_process and target_process != process):
                broken.add((module, target))
    return broken


def test_no_module_imports_a_higher_layer_or_another_process():
    found = sorted(violations())
    assert not found, "imports that break the layers:\n" + "\n".join(
        f"  {a} ({LAYER_NAMES[place(a)[0]]}) imports {b} ({LAYER_NAMES[place(b)[0]]})" for a, b in found
    )


def test_the_layer_rule_catches_a_reversed_import():
    """The check itself: a proto module importing the buffer, or one process another's code,
    is reported."""
    assert place("asyncrl.proto.records")[0] < place("asyncrl.buffer.groups")[0]
    assert place("asyncrl.services.rollout.app")[1] != place("asyncrl.services.reward.app")[1]
    assert own_modules({"asyncrl.services.reward.verifiers.BUILTIN", "numpy"}) == {
        "asyncrl.services.reward.verifiers"
    }
    # a module named in a string (a "module:attr" registry) counts as imported
    registry = source_of("asyncrl.services.reward.verifiers")
    assert "asyncrl.services.reward.verifiers.toy" in named_modules(registry)


BARE = set(FOLDERS)  # proto, buffer, trainer, services: installed only as asyncrl.*


def test_nothing_imports_a_bare_top_level_name():
    """Everywhere in the repository (product code, tests, benchmarks, deploy), the packages are
    imported by their installed names, never by folder (a bare `import trainer` would find
    another distribution's `trainer`, or the folder only when run from the root)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0] in {"runs", "build"}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [f"{rel}:{node.lineno}: {name}" for name in names if name.split(".")[0] in BARE]
    assert not found, "bare imports (use asyncrl.…):\n" + "\n".join(found)


def test_the_installed_packages_are_the_tree():
    """pyproject lists every package folder of the tree under `asyncrl` (a folder left out would
    be missing from the wheel), and nothing else."""
    listed = set(SETUPTOOLS["packages"])
    tree = {module_name(init) for folder in PACKAGE_DIRS.values() for init in folder.rglob("__init__.py")}
    assert listed == tree, (
        f"in pyproject only: {sorted(listed - tree)}; in the tree only: {sorted(tree - listed)}"
    )
    assert all(name.split(".")[0] == NAMESPACE for name in listed)
    loose = sorted(
        str(path.parent.relative_to(ROOT))
        for path in source_files()
        if not (path.parent / "__init__.py").is_file()
    )
    assert not loose, f"folders with modules but no __init__.py (not installed): {sorted(set(loose))}"


def test_the_readme_layout_table_is_the_tree():
    """Every folder the README's layout table names exists, and every top-level folder and every
    package folder directly under services/ is in it (a new process or layer gets a row)."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| path | what |") :]
    table = table[: table.index("\n\n")]
    first_cells = [row.split("|")[1] for row in table.splitlines()[2:]]
    named = {path.rstrip("/") for cell in first_cells for path in re.findall(r"`([\w./-]+/)`", cell)}
    missing = sorted(path for path in named if not (ROOT / path).is_dir())
    assert not missing, f"the README's layout table names folders that do not exist: {missing}"
    expected = {
        p.name
        for p in ROOT.iterdir()
        if p.is_dir()
        and not p.name.startswith(".")
        and p.name not in {"runs", "build", "services"}
        and not p.name.endswith(".egg-info")
    } | {f"services/{p.name}" for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file()}
    covered = {path for path in named if path in expected} | {
        path.split("/")[0] + "/" + path.split("/")[1] for path in named if path.count("/") >= 2
    }
    unlisted = sorted(expected - covered)
    assert not unlisted, f"folders missing from the README's layout table: {unlisted}"


# The one place a process runs code another process owns, through a Python entry point against
# an interface in proto/ (docs/architecture.md §2): group → (the interface, the process that
# loads it, the process that provides it). A new cross-process entry point is a design decision:
# it gets a row here.
SEAMS = {
    "asyncrl.local_scorers": ("asyncrl.proto.verifiers", "rollout", "reward"),
}


def test_cross_process_entry_points_are_declared_seams():
    """Every `asyncrl.*` entry point of pyproject is a seam listed above: its interface is in
    proto/, its target is in the providing process, and the loading process names the group
    only through that proto module's constant (it never names the target's module)."""
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("entry-points", {})
    groups = {group: targets for group, targets in declared.items() if group.startswith(NAMESPACE + ".")}
    assert set(groups) == set(SEAMS), f"entry-point groups without a row in SEAMS: {set(groups) ^ set(SEAMS)}"
    for group, targets in groups.items():
        interface, loader, provider = SEAMS[group]
        assert place(interface)[0] == 0, f"{group}: its interface {interface} is not in proto/"
        assert group in source_of(interface).read_text(), f"{interface} does not define the group {group!r}"
        for target in targets.values():
            module = target.partition(":")[0]
            assert source_of(module) is not None, f"{group}: {target} does not exist"
            assert place(module)[1] == provider, f"{group}: {target} is not in the {provider} process"
        for path in source_files():
            if place(module_name(path))[1] == loader:
                assert group not in strings(path), f"{path}: names {group!r} itself, not through {interface}"
