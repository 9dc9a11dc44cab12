"""`disagg probe HOST:PORT`: handshake a side channel (disagg or vLLM), print what each rank advertises."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="handshake a live NIXL side channel and print what each (pp, tp) rank advertises",
        description=(
            "Sends vLLM's side-channel request for every (pp_rank, tp_rank) and decodes the replies "
            "(hash first, then the agent metadata of vLLM 0.31-0.33). Nothing is added to NIXL. Exits 1 "
            "with the typed reason when a handshake fails."
        ),
    )
    parser.add_argument("target", metavar="HOST:PORT", help="side channel address, e.g. 10.0.0.5:5600")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the engine (default 1)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the engine (default 1)")
    parser.add_argument("--engine-id", help="refuse the reply unless it is for this engine id")
    parser.add_argument("--expect-hash", help="refuse the reply unless its compatibility hash is this one")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for each reply (default 5)"
    )
    parser.set_defaults(func=probe)


def _split_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"target must be HOST:PORT, got {target!r}")
    return host.strip("[]"), int(port)


def describe(
    pp_rank: int,
    tp_rank: int,
    compat_hash: str,
    meta: Any,
    clock_offset_s: float,
    field_versions: tuple[int, ...] = (),
) -> list[str]:
    """Human-readable lines for one rank's decoded metadata; `field_versions` are the connector versions
    whose metadata field set the reply has (`wire.field_set_versions`)."""
    members = list(meta.region_members)
    if field_versions:
        version = f"{' or '.join(map(str, field_versions))} (by the metadata's field set)"
    else:
        version = "unknown (the metadata's fields are no released field set)"
    if not members:
        version += "; no region_members (a peer that does not track layers)"
    capacities = meta.region_num_blocks if meta.region_num_blocks is not None else [meta.num_blocks]
    lines = [
        f"rank (pp {pp_rank}, tp {tp_rank}): engine {meta.engine_id}",
        f"  compatibility hash: {compat_hash}",
        f"  connector version: {version}",
        f"  layout {meta.kv_cache_layout}, backend {meta.attn_backend_name}, "
        f"block size {meta.block_size} tokens ({meta.physical_blocks_per_logical_kv_block} kernel blocks per "
        f"logical block), dcp {meta.dcp_size}, pcp {meta.pcp_size}",
        f"  regions: {len(meta.kv_caches_base_addr)}; block lengths {sorted(set(meta.block_lens))} B; "
        f"capacities {sorted(set(capacities))} blocks; memory {sorted(set(meta.region_mem_types or ['?']))}",
        f"  clock offset: {clock_offset_s * 1e3:+.3f} ms",
    ]
    if members:
        for index, layers in enumerate(members):
            group = meta.region_group_ids[index] if meta.region_group_ids is not None else "?"
            capacity = capacities[index] if len(capacities) > index else capacities[0]
            lines.append(
                f"  region {index}: group {group}, {capacity} blocks of {meta.block_lens[index]} B, "
                f"{len(layers)} layer(s): {', '.join(layers)}"
            )
    return lines


def probe(args: argparse.Namespace) -> int:
    from disagg.worker.connector.side_channel import fetch_payloads
    from disagg.worker.kv import wire
    from disagg.worker.kv.errors import DisaggError

    try:
        host, port = _split_target(args.target)
        if args.pp < 1 or args.tp < 1:
            raise ValueError("--pp and --tp must be at least 1")
        targets = [(pp, tp) for pp in range(args.pp) for tp in range(args.tp)]
        replies = fetch_payloads(host, port, targets, timeout_s=args.timeout)
        for reply in replies:
            envelope = wire.decode_payload_envelope(reply.payload)
            meta = wire.decode_handshake_payload(
                reply.payload, expected_hash=args.expect_hash, expected_engine_id=args.engine_id
            )
            print(
                "\n".join(
                    describe(
                        reply.pp_rank,
                        reply.tp_rank,
                        envelope.compatibility_hash,
                        meta,
                        reply.clock_offset_s,
                        wire.field_set_versions(envelope.agent_metadata_bytes),
                    )
                )
            )
    except DisaggError as exc:
        print(f"probe {args.target} failed: {exc.reason}: {exc.message}")
        return 1
    except ValueError as exc:
        print(f"probe {args.target} failed: InvalidArgument: {exc}")
        return 2
    return 0
