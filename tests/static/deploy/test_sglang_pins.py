"""Every place that names an SGLang release names the one `proto/sglang.py` is checked
against (`SGLANG_RELEASE`): the compose engine image, the k8s engine images and the `gpu`
extra. A pin moved in one place only would run bodies the proto was not checked for."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from asyncrl.proto.sglang import SGLANG_RELEASE

ROOT = Path(__file__).resolve().parents[3]
IMAGE = re.compile(r"lmsysorg/sglang:(?:\$\{SGLANG_IMAGE_TAG:-)?(v[0-9][^}\s]*)")


def test_compose_runs_the_release_the_proto_follows():
    engine = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["engine"]
    assert IMAGE.match(engine["image"]).group(1) == f"v{SGLANG_RELEASE}"


def test_k8s_engines_run_the_release_the_proto_follows():
    images = [
        c["image"]
        for doc in yaml.safe_load_all((ROOT / "deploy/k8s/base/engines.yaml").read_text())
        if doc and doc.get("kind") in {"StatefulSet", "Deployment"}
        for c in doc["spec"]["template"]["spec"]["containers"]
        if c["image"].startswith("lmsysorg/sglang:")
    ]
    assert images and {IMAGE.match(i).group(1) for i in images} == {f"v{SGLANG_RELEASE}"}


def test_the_gpu_extra_pins_the_same_release():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = [d for d in extras["gpu"] if re.match(r"sglang\b(?!-)", d)]
    assert pin == f"sglang=={SGLANG_RELEASE}"
