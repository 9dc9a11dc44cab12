"""What a vLLM release changes for NIXL P/D against the newest release this project supports, and what the
project does not yet handle of it: the second half of `make vllm-release VERSION=X` (hack/vllm/release.sh
fetches, extracts and writes the golden vectors first).

    PYTHONSAFEPATH=1 .venv/bin/python hack/vllm/release.py 0.35.0

The release's facts come from its own code, run by the vLLM test peer (hack/vllm/peer.py `release_facts`):
connector version, agent metadata fields in order, the compatibility-hash factor keys and speculative
sub-dict keys (its own compute_nixl_compatibility_hash), the push protocol files' sha256, the `vllm serve`
option table, and the kernel block sizes of the backends `contracts.attention_backends` fixes. The newest
supported release's facts are the project's own tables (wire, serve options, attention backends) and its
golden manifest. Exit 0 when nothing is missing, 1 otherwise, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "interop"))

from _vllm_peer import INSTALLED_RELEASE, RELEASES, VllmPeer  # noqa: E402

from disagg.worker.contracts import releases  # noqa: E402
from disagg.worker.contracts.attention_backends import KERNEL_BLOCK_SIZES  # noqa: E402
from disagg.worker.contracts.vllm_serve_options import SERVE_OPTIONS  # noqa: E402
from disagg.worker.kv import wire  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "vllm"
NIXL_DIR = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"


def serve_table(facts: dict[str, Any]) -> tuple[bool, tuple[str, ...], tuple[str, ...]]:
    table = facts["serve_options"]
    return table["allow_abbrev"], tuple(table["positionals"]), tuple(table["actions"])


def option_names(actions: tuple[str, ...]) -> set[str]:
    return {line.split(" ", 1)[1] for line in actions}


def declared(name: str) -> list[Any]:
    table = KERNEL_BLOCK_SIZES[name]
    return [*table.sizes, *([{"multiple_of": table.multiple_of}] if table.multiple_of else [])]


def newest_before(version: tuple[int, int, int]) -> releases.Release | None:
    """The newest supported release of an earlier minor line: what `version` is compared against."""
    older = [row for row in releases.RELEASES if row.line < version[:2]]
    return older[-1] if older else None


def golden_manifest(version: str) -> dict[str, Any] | None:
    path = GOLDEN / version / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def speculative_keys(version: str) -> list[str] | None:
    path = GOLDEN / version / "compat_hash_cases.json"
    if not path.is_file():
        return None
    for case in json.loads(path.read_text())["cases"]:
        speculative = case["factors"].get("speculative_config")
        if isinstance(speculative, dict):
            return sorted(speculative)
    return None


def changes(facts: dict[str, Any], base: releases.Release) -> list[str]:
    """What the release changed against `base`, the newest supported release before it."""
    told = []
    if facts["connector_version"] != base.connector_version:
        told.append(f"connector version {base.connector_version} -> {facts['connector_version']}")
    old_fields = list(base.metadata_fields)
    new_fields = [f["name"] for f in facts["metadata_fields"]]
    if new_fields != old_fields:
        added = [f for f in new_fields if f not in old_fields]
        removed = [f for f in old_fields if f not in new_fields]
        where = ", ".join(
            f"{name} after {new_fields[new_fields.index(name) - 1]}"
            for name in added
            if new_fields.index(name)
        )
        told.append(
            f"NixlAgentMetadata: {len(old_fields)} -> {len(new_fields)} fields"
            + (f"; added {where}" if added else "")
            + (f"; removed {removed}" if removed else "")
            + ("" if added or removed else "; reordered")
        )
    if facts["hash_factor_keys"] is not None and list(facts["hash_factor_keys"]) != list(
        base.hash_factor_keys
    ):
        told.append(
            f"compatibility-hash factor keys: {list(base.hash_factor_keys)} -> {facts['hash_factor_keys']}"
        )
    spec, old_spec = facts["speculative_keys"], speculative_keys(base.tested)
    if spec is not None and old_spec is not None and spec != old_spec:
        gone, new = sorted(set(old_spec) - set(spec)), sorted(set(spec) - set(old_spec))
        told.append(f"hashed speculative_config keys: removed {gone}, added {new}")
    manifest = golden_manifest(base.tested)
    if manifest is not None:
        old_files = {
            path.rsplit("/", 1)[1]: entry["sha256"]
            for path, entry in manifest["how_generated"]["provenance"]["files"].items()
            if path.startswith(NIXL_DIR)
        }
        changed = [
            name
            for name, digest in facts["protocol_files"].items()
            if name in old_files and digest != old_files[name]
        ]
        same = [name for name, digest in facts["protocol_files"].items() if old_files.get(name) == digest]
        if changed:
            told.append(f"push protocol files changed (review them): {', '.join(changed)}")
        if same:
            told.append(f"push protocol files byte-identical: {', '.join(same)}")
    old_table = SERVE_OPTIONS.get(base.tested)
    if old_table is not None:
        old, new = set(old_table[2]), set(serve_table(facts)[2])
        both = option_names(tuple(old)) & option_names(tuple(new))
        for what, lines in (
            ("added", [line for line in new - old if line.split(" ", 1)[1] not in both]),
            ("removed", [line for line in old - new if line.split(" ", 1)[1] not in both]),
            ("changed (nargs; o: takes JSON)", [line for line in new - old if line.split(" ", 1)[1] in both]),
        ):
            if lines:
                told.append(f"vllm serve options {what}: {', '.join(sorted(lines))}")
    return told


def missing(facts: dict[str, Any], version: str) -> list[str]:
    """What the project does not yet handle of the release; empty when it is supported throughout."""
    gaps = list(facts["problems"])
    connector = facts["connector_version"]
    row = releases.release_of(version)
    if row is None or row.connector_version != connector:
        gaps.append(
            f"no release row speaking connector version {connector}: add ConnectorVersion({connector}, "
            f'"{version}") to disagg.worker.kv.wire.versions.VERSIONS (with a Since({connector}) on each new '
            "field)"
        )
    fields = [f["name"] for f in facts["metadata_fields"]]
    ours = list(wire.metadata_fields(connector)) if connector in wire.CONNECTOR_VERSIONS else fields
    if ours != fields:
        gaps.append(f"the wire struct at version {connector} has {ours}, the release {fields}")
    keys = facts["hash_factor_keys"]
    if (
        keys is not None
        and connector in wire.CONNECTOR_VERSIONS
        and list(wire.compat_factor_keys(connector)) != keys
    ):
        gaps.append(f"the hash factor keys at version {connector} are not the release's {keys}")
    if SERVE_OPTIONS.get(version) != serve_table(facts):
        gaps.append(
            "the vllm serve option table (worker/contracts/vllm_serve_options.py) lacks or differs from the "
            "release's: add it to tests/interop/_vllm_peer.py RELEASES and run hack/vllm/serve_options.py"
        )
    manifest = golden_manifest(version)
    if manifest is None or manifest.get("nixl_connector_version") != connector or manifest.get("problems"):
        gaps.append(f"no clean golden vectors in tests/golden/vllm/{version} (hack/vllm/golden.py)")
    if version not in RELEASES:
        gaps.append(f"the interop tests do not run it: add {version} to tests/interop/_vllm_peer.py RELEASES")
    wheels = (ROOT / "hack" / "vllm" / "wheels.sh").read_text()
    listed = re.search(r"^RELEASES=\(([^)]*)\)", wheels, re.MULTILINE)
    if version != INSTALLED_RELEASE and (listed is None or version not in listed.group(1).split()):
        gaps.append(f"make test does not fetch it: add {version} to RELEASES in hack/vllm/wheels.sh")
    for name, sizes in facts["kernel_block_sizes"].items():
        if sorted(map(str, sizes if isinstance(sizes, list) else [sizes])) != sorted(
            map(str, declared(name))
        ):
            table = declared(name)
            gaps.append(
                f"kernel block sizes of {name} are {sizes}, contracts.attention_backends says {table}"
            )
    return gaps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="a vLLM release, e.g. 0.35.0")
    parser.add_argument("--json", action="store_true", help="print the release's facts as JSON too")
    args = parser.parse_args(argv)
    parsed = releases.parse_version(args.version)
    if parsed is None:
        print(f"release.py: {args.version!r} is no release version", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        peer = VllmPeer(args.version, Path(scratch) / "peer.log", Path(scratch) / "hf")
        try:
            facts = peer.call("release_facts", backends=sorted(KERNEL_BLOCK_SIZES))
        finally:
            peer.close()
    if args.json:
        print(json.dumps({k: v for k, v in facts.items() if k != "serve_options"}, indent=2))
    base = newest_before(parsed)
    print(
        f"vLLM {args.version}: NIXL connector version {facts['connector_version']}, "
        f"{len(facts['metadata_fields'])} agent metadata fields"
    )
    if base is None:
        print("  (no supported release before it to compare with)")
    else:
        print(f"changed against vLLM {base.tested} (the newest supported release before it):")
        for line in changes(facts, base) or ["nothing the project reads"]:
            print(f"  - {line}")
    gaps = missing(facts, args.version)
    if gaps:
        print(f"not yet handled ({len(gaps)}):")
        for gap in gaps:
            print(f"  - {gap}")
        return 1
    print("not yet handled: nothing; the project supports this release throughout")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
