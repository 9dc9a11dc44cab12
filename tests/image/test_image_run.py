"""The images' programs run for real inside their unpacked root file systems, as the images' user: the
commands of `disagg --help`, the light image's runtime modules without torch or NIXL, and a transfer
sidecar (real NIXL agent) in the transfer image whose side channel is handshaken from the host with the
project's client and from the light image with `disagg probe`."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from image_layout import Image, commands_in_help, in_root_argv, run_in_root

from disagg.rig.local import LOOPBACK_UCX_ENV, free_port
from disagg.worker.connector.side_channel import fetch_payloads
from disagg.worker.contracts.payload_facts import payload_facts
from disagg.worker.kv import wire
from disagg.worker.kv.layout import ModelGeometry, build_stage_layout
from disagg.worker.link.engine_link import EngineLink, register_layout_message
from disagg.worker.link.kv_pool import ShmPool

# Commands every image has (the operator's and the worker's halves), and the `--help` of each subcommand
# that the images' processes run; a command listed by `disagg --help` is checked whenever it is there, so
# `router` and `engine` are picked up as soon as they exist.
REQUIRED_COMMANDS = {"operator", "worker", "probe", "check", "plan", "crd", "wire", "compat"}
PROCESS_HELP = {
    "operator": ["operator", "run", "--help"],
    "worker": ["worker", "sidecar", "--help"],
    "router": ["router", "run", "--help"],
    "engine": ["engine", "serve", "--help"],
}
# What the light image runs, imported for real: with no torch or NIXL installed, each import would fail.
LIGHT_MODULES = [
    "disagg.operator.control.handlers",
    "disagg.operator.control.webhook",
    "disagg.worker.reporting.watch",
    "disagg.worker.connector.side_channel",
]


def _disagg(image: Image, rootfs: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_in_root(image, rootfs, [*image.runtime["Entrypoint"], *args])


@pytest.mark.parametrize("which", ["light", "transfer"])
def test_every_command_the_image_lists_starts_as_its_user(which: str, request: pytest.FixtureRequest) -> None:
    image: Image = request.getfixturevalue(which)
    rootfs: Path = request.getfixturevalue(f"{which}_root")
    top = _disagg(image, rootfs, "--help")
    assert top.returncode == 0, top.stderr
    commands = commands_in_help(top.stdout)
    assert commands >= REQUIRED_COMMANDS, f"missing: {REQUIRED_COMMANDS - commands}"
    # `disagg` with the image's config alone (entry point plus its default arguments) is the same help.
    default = run_in_root(image, rootfs, [*image.runtime["Entrypoint"], *image.runtime["Cmd"]])
    assert default.stdout == top.stdout
    whoami = run_in_root(image, rootfs, ["/usr/bin/id", "-u"])
    assert whoami.stdout.strip() == "65532"
    for command in sorted(commands):
        argv = PROCESS_HELP.get(command, [command, "--help"])
        done = _disagg(image, rootfs, *argv)
        assert done.returncode == 0, f"disagg {' '.join(argv)}: {done.stderr}"
        assert done.stdout.startswith("usage: disagg "), done.stdout


def test_the_light_image_runs_the_operator_webhook_and_watch_code_without_torch_or_nixl(
    light: Image, light_root: Path
) -> None:
    imports = "; ".join(f"import {module}" for module in LIGHT_MODULES)
    code = (
        f"{imports}; import importlib.util, sys; "
        "heavy = [m for m in ('torch', 'nixl_cu12', 'nixl') if importlib.util.find_spec(m)]; "
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('torch', 'nixl_cu12', 'nixl')]; "
        "print(heavy, loaded)"
    )
    done = run_in_root(light, light_root, ["/opt/disagg/bin/python", "-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] []"


def _get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, ConnectionError):
        return 0


GEOMETRY = ModelGeometry.with_full_every(4, 2, num_kv_heads=2, head_size=8, dtype_bytes=2)
BLOCK_SIZE, NUM_BLOCKS = 16, 8
ENGINE_ID = "image-test-prefill"


@pytest.fixture
def kv_dir(transfer_root: Path) -> Iterator[Path]:
    """A directory of the transfer image's /tmp that its user owns: topology, engine socket and KV pool."""
    path = transfer_root / "tmp/kv"
    path.mkdir()
    os.chown(path, 65532, 65532)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def test_a_transfer_sidecar_in_the_image_answers_handshakes_from_the_host_and_the_light_image(
    transfer: Image, transfer_root: Path, light: Image, light_root: Path, kv_dir: Path
) -> None:
    topology = {
        "transferMode": "push",
        "blockSize": BLOCK_SIZE,
        "stages": [{"stage": 0, "startLayer": 0, "endLayer": GEOMETRY.num_layers}],
        "model": {
            "layerKinds": [kind.value for kind in GEOMETRY.kinds],
            "numKVHeads": GEOMETRY.num_kv_heads,
            "headSize": GEOMETRY.head_size,
            "dtypeBytes": GEOMETRY.dtype_bytes,
        },
    }
    (kv_dir / "topology.json").write_text(json.dumps(topology))
    side_channel, metrics = free_port(), free_port()
    env = {
        **LOOPBACK_UCX_ENV,
        "DISAGG_ROLE": "prefill",
        "DISAGG_ENGINE_ID": ENGINE_ID,
        "DISAGG_PP_RANK": "0",
        "DISAGG_TOPOLOGY_FILE": "/tmp/kv/topology.json",
        "DISAGG_ENGINE_SOCKET": "/tmp/kv/engine.sock",
        "DISAGG_SIDE_CHANNEL_HOST": "127.0.0.1",
        "DISAGG_SIDE_CHANNEL_PORT": str(side_channel),
        "DISAGG_METRICS_HOST": "127.0.0.1",
        "DISAGG_METRICS_PORT": str(metrics),
    }
    argv = in_root_argv(transfer, transfer_root, ["disagg", "worker", "sidecar", "--mode", "transfer"], env)
    log_path = kv_dir.parent / "sidecar.log"
    with open(log_path, "wb") as log:
        sidecar = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while _get(metrics, "/healthz") != 200 or not (kv_dir / "engine.sock").exists():
            assert sidecar.poll() is None, f"sidecar exited {sidecar.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"sidecar not up:\n{log_path.read_text()}"
            time.sleep(0.1)
        assert _get(metrics, "/readyz") == 503

        # The engine's part, from the host: a KV pool the image's user can map, and its registration.
        stage = build_stage_layout(
            GEOMETRY, pp_rank=0, pp_size=1, tp_size=1, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS
        )
        pool = ShmPool.create(kv_dir / "pool.kv", stage.total_bytes)
        os.chown(kv_dir / "pool.kv", 65532, 65532)
        registration = register_layout_message(
            engine_id=ENGINE_ID,
            role="prefill",
            geometry=GEOMETRY,
            stage=stage,
            tp_rank=0,
            num_blocks=NUM_BLOCKS,
            pool_path="/tmp/kv/pool.kv",
            pool_bytes=pool.nbytes,
        )
        with EngineLink(str(kv_dir / "engine.sock")) as link:
            link.register_layout(registration)
        assert _get(metrics, "/readyz") == 200

        (reply,) = fetch_payloads("127.0.0.1", side_channel, [(0, 0)], timeout_s=10)
        compat_hash = payload_facts(reply.payload).compatibility_hash
        meta = wire.decode_handshake_payload(
            reply.payload, expected_hash=compat_hash, expected_engine_id=ENGINE_ID
        )
        assert (meta.engine_id, meta.block_size, meta.num_blocks) == (ENGINE_ID, BLOCK_SIZE, NUM_BLOCKS)

        # The light image's client handshakes the same side channel (what its watch sidecar does).
        probed = run_in_root(
            light,
            light_root,
            [
                "disagg",
                "probe",
                f"127.0.0.1:{side_channel}",
                "--engine-id",
                ENGINE_ID,
                "--expect-hash",
                compat_hash,
            ],
        )
        assert probed.returncode == 0, probed.stdout + probed.stderr
        assert f"rank (pp 0, tp 0): engine {ENGINE_ID}" in probed.stdout
        assert f"compatibility hash: {compat_hash}" in probed.stdout
        refused = run_in_root(
            light,
            light_root,
            ["disagg", "probe", f"127.0.0.1:{side_channel}", "--engine-id", "someone-else"],
        )
        assert refused.returncode == 1 and "failed:" in refused.stdout
        pool.close()
    finally:
        sidecar.terminate()
        code = sidecar.wait(timeout=60)
    assert code == 0, log_path.read_text()
