"""`pip install .` into an empty venv puts one name on the import path, `asyncrl`, and one
console script, `asyncrl`: the folders proto/, buffer/, trainer/ and services/ are installed
under the namespace (pyproject's package-dir), never as top-level packages of their own."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FOLDERS = ("proto", "buffer", "trainer", "services")


def test_an_empty_venv_gets_only_the_asyncrl_namespace(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # The wheel is built from a copy of the sources (an in-tree build would leave build/ and
    # egg-info in the checkout) with this venv's setuptools (no download), then installed into
    # the empty venv without dependencies: the question is what this distribution installs.
    src = tmp_path / "src"
    for name in (*FOLDERS, "pyproject.toml", "README.md"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--no-cache-dir"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, timeout=300, capture_output=True)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("asyncrl-*.whl")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", str(wheel)],
                   check=True, timeout=300, capture_output=True)  # fmt: skip
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    installed = {p.name for p in purelib.iterdir()} - {"__pycache__"}
    assert installed == {"asyncrl", "asyncrl-0.1.0.dist-info"}, installed
    assert sorted(p.name for p in (venv / "bin").iterdir() if p.name not in _venv_own(venv)) == ["asyncrl"]
    entry = (purelib / "asyncrl-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "asyncrl = asyncrl.services.ops.cli:main" in entry

    # Every source module is in the wheel, at its namespaced path.
    for folder in FOLDERS:
        source = {p.relative_to(ROOT / folder) for p in (ROOT / folder).rglob("*.py")}
        shipped = {
            p.relative_to(purelib / "asyncrl" / folder) for p in (purelib / "asyncrl" / folder).rglob("*.py")
        }
        assert source == shipped, (folder, sorted(source ^ shipped))

    # From outside the repository, without site-packages of this venv's own (-S, the path set by
    # hand): the namespace resolves into the install, the bare names resolve to nothing.
    probe = (
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(purelib)!r})\n"
        "spec = importlib.util.find_spec('asyncrl.services.ops.cli')\n"
        "print(spec.origin)\n"
        f"print([importlib.util.find_spec(n) for n in {FOLDERS!r}])\n"
    )
    out = subprocess.run(
        [str(python), "-S", "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path
    )
    origin, bare = out.stdout.splitlines()
    assert Path(origin) == purelib / "asyncrl" / "services" / "ops" / "cli.py"
    assert bare == "[None, None, None, None]"


def _venv_own(venv: Path) -> set[str]:
    """What `python -m venv --without-pip` puts in bin/ by itself."""
    return {"python", "python3", f"python{sysconfig.get_python_version()}", "activate", "activate.csh",
            "activate.fish", "Activate.ps1"}  # fmt: skip
