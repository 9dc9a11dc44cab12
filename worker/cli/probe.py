"""`disagg probe HOST:PORT`: handshake a side channel (disagg or vLLM), print what each rank advertises.

It asks only for the ranks it is given (`--pp`/`--tp`, or a topology document's sizes for a role), never
more: vLLM's listener looks the requested `(pp_rank, tp_rank)` up unguarded, and a rank the engine does not
serve ends its listener thread until the engine restarts. Without sizes it asks for `(pp 0, tp 0)` only,
which every engine serves. A PP prefill engine serves every rank from its head pod's address.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="handshake a live NIXL side channel and print what each (pp, tp) rank advertises",
        description=(
            "Sends vLLM's side-channel request for each (pp_rank, tp_rank) it is given and decodes the "
            "replies (hash first, then the agent metadata). It asks only for the ranks --pp/--tp or "
            "--topology give (else pp 0, tp 0 alone): a vLLM engine asked for a rank it does not serve "
            "loses its side channel. Nothing is added to NIXL. Exits 1 with the typed reason when a "
            "handshake fails."
        ),
    )
    parser.add_argument("target", metavar="HOST:PORT", help="side channel address, e.g. 10.0.0.5:5600")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size of the engine")
    parser.add_argument("--tp", type=int, help="tensor-parallel size of the engine")
    parser.add_argument(
        "--topology",
        metavar="FILE",
        help="take the sizes from this topology document (the operator's ConfigMap, JSON or YAML)",
    )
    parser.add_argument(
        "--role",
        choices=("prefill", "decode"),
        default="prefill",
        help="with --topology: the engine's role (default prefill)",
    )
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


def connector_line(facts: Any, has_members: bool) -> str:
    """What the payload's field set says of the connector version (vLLM writes every field, defaults too;
    14 and 15 write the same fields, only the hash tells them apart)."""
    versions = facts.connector_versions
    if versions:
        line = f"{' or '.join(map(str, versions))} (by the metadata's field set)"
    else:
        line = "unknown (the metadata's fields are no released field set)"
    if not has_members:
        line += "; no region_members (a peer that does not track layers)"
    return line


def describe(
    pp_rank: int, tp_rank: int, compat_hash: str, meta: Any, clock_offset_s: float, facts: Any
) -> list[str]:
    """Human-readable lines for one rank's decoded metadata."""
    members = list(meta.region_members)
    capacities = meta.region_num_blocks if meta.region_num_blocks is not None else [meta.num_blocks]
    lines = [
        f"rank (pp {pp_rank}, tp {tp_rank}): engine {meta.engine_id}",
        f"  compatibility hash: {compat_hash}",
        f"  connector version: {connector_line(facts, bool(members))}",
        f"  layout {meta.kv_cache_layout}, backend {meta.attn_backend_name}, "
        f"block size {meta.block_size} tokens ({meta.physical_blocks_per_logical_kv_block} kernel blocks per "
        f"logical block), dcp {meta.dcp_size}, pcp {meta.pcp_size}",
        f"  regions: {len(meta.kv_caches_base_addr)}; block lengths {sorted(set(meta.block_lens))} B; "
        f"capacities {sorted(set(capacities))} blocks; memory {sorted(set(meta.region_mem_types or ['?']))}",
        f"  clock offset: {clock_offset_s * 1e3:+.3f} ms",
    ]
    if facts.ple_block_len is not None:
        lines.append(f"  ple_block_len: {facts.ple_block_len} B")
    if facts.packed_member_layouts:
        packed = ", ".join(f"{name} {list(value)}" for name, value in facts.packed_member_layouts.items())
        lines.append(f"  packed_member_layouts: {packed}")
    if members:
        for index, layers in enumerate(members):
            group = meta.region_group_ids[index] if meta.region_group_ids is not None else "?"
            capacity = capacities[index] if len(capacities) > index else capacities[0]
            lines.append(
                f"  region {index}: group {group}, {capacity} blocks of {meta.block_lens[index]} B, "
                f"{len(layers)} layer(s): {', '.join(layers)}"
            )
    return lines


def ranks(args: argparse.Namespace) -> tuple[list[tuple[int, int]], str]:
    """The ranks to ask for and where they came from; never more than the user or the topology says."""
    if args.topology is not None:
        if args.pp is not None or args.tp is not None:
            raise ValueError("give either --topology or --pp/--tp, not both")
        from disagg.worker.sidecar.config import load_topology

        topology = load_topology(args.topology)
        pp = topology.prefill_pp if args.role == "prefill" else 1
        tp = topology.prefill_tp if args.role == "prefill" else topology.decode_tp
        source = f"the topology {args.topology} ({args.role}: PP {pp} x TP {tp})"
    elif args.pp is None and args.tp is None:
        return [(0, 0)], "none given: (pp 0, tp 0) only, which every engine serves (--pp/--tp for the rest)"
    else:
        pp, tp = args.pp or 1, args.tp or 1
        source = f"--pp {pp} --tp {tp}"
    if pp < 1 or tp < 1:
        raise ValueError("--pp and --tp must be at least 1")
    return [(p, t) for p in range(pp) for t in range(tp)], source


def probe(args: argparse.Namespace) -> int:
    from disagg.worker.connector.side_channel import fetch_payloads
    from disagg.worker.kv import wire
    from disagg.worker.kv.errors import DisaggError
    from disagg.worker.kv.payload_facts import payload_facts

    try:
        host, port = _split_target(args.target)
        targets, source = ranks(args)
        print(f"ranks: {source}")
        replies = fetch_payloads(host, port, targets, timeout_s=args.timeout)
        for reply in replies:
            facts = payload_facts(reply.payload)
            meta = wire.decode_handshake_payload(
                reply.payload, expected_hash=args.expect_hash, expected_engine_id=args.engine_id
            )
            print(
                "\n".join(
                    describe(
                        reply.pp_rank,
                        reply.tp_rank,
                        facts.compatibility_hash,
                        meta,
                        reply.clock_offset_s,
                        facts,
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
