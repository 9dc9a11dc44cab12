"""The images' configs (user, entry point, environment, labels, layers) and what their root file systems hold
and do not hold (no build tools, package lists, caches; torch and NIXL only in the transfer image)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import pytest
from image_layout import REPO, Image, chart_app_version, project_version

VENV = Path("opt/disagg")
SITE = VENV / "lib/python3.11/site-packages"


def test_the_tag_is_the_project_version_and_the_charts_app_version(light: Image, transfer: Image) -> None:
    assert project_version() == chart_app_version()
    for image in (light, transfer):
        assert image.tag == project_version()
        assert image.labels["org.opencontainers.image.version"] == project_version()


@pytest.mark.parametrize("which", ["light", "transfer"])
def test_runs_as_a_non_root_user_with_the_disagg_entry_point(
    which: str, request: pytest.FixtureRequest
) -> None:
    image: Image = request.getfixturevalue(which)
    runtime = image.runtime
    uid, _, gid = runtime["User"].partition(":")
    assert int(uid) == 65532 and int(gid) == 65532
    assert runtime["Entrypoint"] == ["/opt/disagg/bin/disagg"]
    assert runtime["WorkingDir"] == "/home/disagg"
    # The operator's pod specs say `command: ["disagg"]`: PATH must find the venv's entry point first.
    assert image.env()["PATH"].split(":")[0] == "/opt/disagg/bin"
    assert image.env()["PYTHONDONTWRITEBYTECODE"] == "1"
    assert image.config["os"] == "linux" and image.config["architecture"] == "amd64"


@pytest.mark.parametrize("which", ["light", "transfer"])
def test_labels_name_source_version_licence_revision_and_the_commit_time(
    which: str, request: pytest.FixtureRequest
) -> None:
    image: Image = request.getfixturevalue(which)
    labels = image.labels
    with open(REPO / "pyproject.toml", "rb") as f:
        licence = tomllib.load(f)["project"]["license"]
    assert labels["org.opencontainers.image.licenses"] == licence
    assert labels["org.opencontainers.image.source"].startswith("https://")
    assert labels["org.opencontainers.image.title"] == image.name
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", labels["org.opencontainers.image.revision"])
    created = labels["org.opencontainers.image.created"]
    # Reproducible dates: the image, every history entry and the label are one time, that of a commit.
    assert image.config["created"] == created
    assert {entry["created"] for entry in image.config["history"]} == {created}
    revision = labels["org.opencontainers.image.revision"].removesuffix("-dirty")
    commit_time = subprocess.run(
        ["git", "-C", str(REPO), "log", "-1", "--format=%ct", revision], capture_output=True, text=True
    )
    if commit_time.returncode == 0:  # the commit the image was built from is in this clone
        expected = datetime.fromtimestamp(int(commit_time.stdout), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        assert created == expected
    # The manifest carries the same labels as annotations, where registries show them.
    assert (
        image.manifest["annotations"]["org.opencontainers.image.revision"]
        == labels["org.opencontainers.image.revision"]
    )


def test_both_images_share_the_debian_base_layer(light: Image, transfer: Image) -> None:
    light_layers = [layer["digest"] for layer in light.manifest["layers"]]
    transfer_layers = [layer["digest"] for layer in transfer.manifest["layers"]]
    assert len(light_layers) == len(transfer_layers) == 2
    assert light_layers[0] == transfer_layers[0]
    assert light_layers[1] != transfer_layers[1]


def _passwd(rootfs: Path) -> dict[str, list[str]]:
    return {line.split(":")[0]: line.split(":") for line in (rootfs / "etc/passwd").read_text().splitlines()}


@pytest.mark.parametrize("which", ["light_root", "transfer_root"])
def test_the_root_file_system_holds_no_build_tools_package_lists_or_caches(
    which: str, request: pytest.FixtureRequest
) -> None:
    rootfs: Path = request.getfixturevalue(which)
    user = _passwd(rootfs)["disagg"]
    assert user[2:4] == ["65532", "65532"] and user[5] == "/home/disagg" and user[6] == "/usr/sbin/nologin"
    home = rootfs / "home/disagg"
    assert (home.stat().st_uid, home.stat().st_gid) == (65532, 65532)
    assert (rootfs / "usr/bin/python3.11").is_file()
    for absent in [
        "root/.cache",
        "home/disagg/.cache",
        "usr/bin/apt",
        "usr/bin/apt-get",
        "usr/bin/gcc",
        "usr/bin/cc",
        "usr/bin/g++",
        "usr/bin/make",
        "usr/bin/ld",
        "run/disagg-wheels",
        VENV / "bin/pip",
        VENV / "bin/pip3",
        SITE / "pip",
    ]:
        assert not (rootfs / absent).exists(), f"/{absent} is in the image"
    lists = rootfs / "var/lib/apt/lists"
    assert not lists.exists() or not [p for p in lists.rglob("*") if p.is_file()], (
        "apt lists are in the image"
    )
    archives = rootfs / "var/cache/apt"
    assert not archives.exists() or not list(archives.rglob("*.deb")), "downloaded debs are in the image"
    assert not list((rootfs / "var/log").rglob("*.log")), "build logs are in the image"
    assert not [p for p in (rootfs / "tmp").iterdir()], "/tmp is not empty"
    assert not [p for p in (rootfs / "usr/share/doc").rglob("*") if p.is_file() and p.name != "copyright"]
    # Bytecode is the build's, hash-based (PEP 552 flags 0b01): nothing the image wrote when it ran.
    pycs = list((rootfs / SITE).rglob("*.pyc"))
    assert pycs
    timestamped = [p for p in pycs if int.from_bytes(p.read_bytes()[4:8], "little") != 1]
    assert not timestamped, f"{len(timestamped)} timestamp-based .pyc files, e.g. {timestamped[:3]}"
    # The only bytecode is Debian's, of its own python3.11, and the build's, of the venv.
    python = [rootfs / SITE, rootfs / "usr/lib/python3.11", rootfs / "usr/lib/python3/dist-packages"]
    strays = [p for p in rootfs.rglob("__pycache__") if not any(p.is_relative_to(d) for d in python)]
    assert not strays, f"__pycache__ outside the Python trees: {strays[:5]}"


def _distributions(rootfs: Path) -> dict[str, str]:
    found = {}
    for info in (rootfs / SITE).glob("*.dist-info"):
        name, _, version = info.name.removesuffix(".dist-info").partition("-")
        found[name.lower().replace("_", "-")] = version
    return found


def _locked(lock: str) -> dict[str, str]:
    pins = re.findall(r"^([a-z0-9_.-]+)==(\S+)", (REPO / "hack/image" / lock).read_text(), re.M)
    return {name.replace("_", "-"): version for name, version in pins}


def test_the_light_image_holds_the_light_lock_and_no_torch_or_nixl(light_root: Path) -> None:
    installed = _distributions(light_root)
    assert installed == {**_locked("light.lock"), "disagg": project_version()}
    for heavy in ("torch", "nixl_cu12", "nixl", "nvidia"):
        assert not (light_root / SITE / heavy).exists()


def test_the_transfer_image_holds_the_transfer_lock_with_cpu_torch_and_nixl(transfer_root: Path) -> None:
    installed = _distributions(transfer_root)
    assert installed == {**_locked("transfer.lock"), "disagg": project_version()}
    assert installed["torch"] == "2.13.0+cpu"
    assert installed["nixl-cu12"] == "1.5.1"
