"""Helpers of the image tests: read an OCI image layout, unpack an image, run its programs inside its root.

A module of its own (not conftest.py): several test folders have a conftest.py, and `from conftest import`
would pick whichever was imported first.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "build" / "images"
LIGHT = "disagg"
TRANSFER = "disagg-transfer"


def project_version() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        version: str = tomllib.load(f)["project"]["version"]
    return version


def chart_app_version() -> str:
    match = re.search(r'^appVersion:\s*"?([^"\s]+)"?', (REPO / "charts/disagg/Chart.yaml").read_text(), re.M)
    assert match is not None
    return match.group(1)


@dataclass(frozen=True)
class Image:
    """One tagged image of a layout: its manifest and config, as the layout's JSON holds them."""

    name: str
    layout: Path
    tag: str
    manifest: dict[str, Any]
    config: dict[str, Any]

    @classmethod
    def read(cls, name: str, tag: str) -> Image:
        layout = IMAGES / name
        index = json.loads((layout / "index.json").read_text())
        refs = {
            m.get("annotations", {}).get("org.opencontainers.image.ref.name"): m for m in index["manifests"]
        }
        assert tag in refs, f"{layout} has no tag {tag} (tags: {sorted(map(str, refs))})"
        manifest = json.loads(cls._blob(layout, refs[tag]["digest"]))
        config = json.loads(cls._blob(layout, manifest["config"]["digest"]))
        return cls(name, layout, tag, manifest, config)

    @staticmethod
    def _blob(layout: Path, digest: str) -> bytes:
        algorithm, _, hexdigest = digest.partition(":")
        return (layout / "blobs" / algorithm / hexdigest).read_bytes()

    @property
    def runtime(self) -> dict[str, Any]:
        runtime: dict[str, Any] = self.config["config"]
        return runtime

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.runtime.get("Labels") or {}
        return labels

    def env(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.runtime.get("Env", []))


def unpack(image: Image) -> Path:
    """The image's root file system, unpacked by umoci into a fresh short directory (socket paths inside it
    stay under the 107-byte limit); the caller removes it."""
    target = Path(tempfile.mkdtemp(prefix=f"{image.name}-", dir="/var/tmp"))
    rootfs = target / "rootfs"
    subprocess.run(
        ["umoci", "raw", "unpack", "--image", f"{image.layout}:{image.tag}", str(rootfs)],
        check=True,
        capture_output=True,
    )
    return rootfs


def remove(rootfs: Path) -> None:
    shutil.rmtree(rootfs.parent, ignore_errors=True)


def in_root_argv(
    image: Image, rootfs: Path, argv: list[str], extra_env: dict[str, str] | None = None
) -> list[str]:
    """`argv` as the image's config runs it: its user, environment and working directory, chrooted into
    `rootfs`, with /proc, /dev and /sys mounted in a private mount namespace (gone when the process exits)."""
    env = {**image.env(), **(extra_env or {})}
    user = image.runtime["User"]
    workdir = image.runtime.get("WorkingDir") or "/"
    script = (
        'root=$1; shift; mount -t proc proc "$root/proc"; mount --rbind /dev "$root/dev"; '
        'mount --rbind /sys "$root/sys"; exec chroot --userspec="$USERSPEC" "$root" "$@"'
    )
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "env",
        f"USERSPEC={user}",
        "bash",
        "-ec",
        script,
        "in_root",
        str(rootfs),
        "/usr/bin/env",
        "-i",
        f"--chdir={workdir}",
        *(f"{k}={v}" for k, v in env.items()),
        *argv,
    ]


def run_in_root(
    image: Image, rootfs: Path, argv: list[str], timeout: float = 120, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        in_root_argv(image, rootfs, argv, extra_env), capture_output=True, text=True, timeout=timeout
    )


def commands_in_help(help_text: str) -> set[str]:
    """The subcommands `disagg --help` lists: the names indented under `COMMAND`, up to `options:`."""
    _, found, rest = help_text.partition("\n  COMMAND\n")
    assert found, f"no command list in:\n{help_text}"
    listing = rest.split("\noptions:", 1)[0]
    return set(re.findall(r"^    ([a-z][a-z0-9-]*)(?:\s|$)", listing, re.M))
