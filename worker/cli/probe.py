"""`disagg probe HOST:PORT`: handshake a side channel (disagg or vLLM), print what each rank advertises.

It never asks an engine for a rank the engine may not serve: vLLM's listener looks the requested
`(pp_rank, tp_rank)` up unguarded, and a rank it does not serve ends its listener thread (a KeyError) until
the engine restarts. So it asks for `(pp 0, tp 0)` first, which every engine serves, and asks for more only
once that head's own payload confirms the pipeline the user or the topology claims: the layers its regions
hold must be stage 0's layers of that pipeline (which takes the model's layer count, `--num-layers` or the
topology's). A claim the payload contradicts is refused, saying what the payload shows; one it cannot
confirm is refused too, never guessed. A PP prefill engine serves every rank from its head pod's address.
Nothing in a payload tells how many TP ranks an engine has, so TP ranks are asked for only as the topology
gives them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="handshake a live NIXL side channel and print what each (pp, tp) rank advertises",
        description=(
            "Sends vLLM's side-channel request for each (pp_rank, tp_rank) it is given and decodes the "
            "replies (hash first, then the agent metadata). It asks for (pp 0, tp 0) first and for the "
            "ranks --pp/--tp or --topology give only once that head's payload confirms the pipeline (the "
            "layers it holds; --pp needs --num-layers for that, TP ranks --topology): a vLLM engine asked "
            "for a rank it does not serve loses its side channel. Nothing is added to NIXL. Exits 1 with "
            "the typed reason when a handshake fails or the payload contradicts or cannot confirm the "
            "claimed ranks."
        ),
    )
    parser.add_argument("target", metavar="HOST:PORT", help="side channel address, e.g. 10.0.0.5:5600")
    parser.add_argument("--pp", type=int, help="pipeline-parallel size of the engine")
    parser.add_argument("--tp", type=int, help="tensor-parallel size of the engine")
    parser.add_argument(
        "--num-layers",
        type=int,
        help="with --pp: the model's layer count, so the head's payload can confirm the pipeline",
    )
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


@dataclass(frozen=True)
class RankClaim:
    """What the user or the topology says the engine serves, and what it takes to confirm the pipeline."""

    pp: int
    tp: int
    source: str
    # The layers stage 0 holds under that pipeline, when the model's layer count is known.
    num_layers: int | None = None
    stage0: range | None = None
    # The operator's topology is its record of how the engine was started: a payload that names no layers
    # (a non-HMA vLLM engine leaves region_members empty) does not contradict it.
    from_topology: bool = False

    @property
    def ranks(self) -> list[tuple[int, int]]:
        return [(p, t) for p in range(self.pp) for t in range(self.tp)]


def claimed_ranks(args: argparse.Namespace) -> RankClaim:
    """The ranks the user or the topology names; the head's payload must confirm them (`pipeline_refusal`)."""
    from disagg.worker.kv.layout import pp_partition

    if args.topology is not None:
        if args.pp is not None or args.tp is not None or args.num_layers is not None:
            raise ValueError("give either --topology or --pp/--tp/--num-layers, not both")
        from disagg.worker.sidecar.config import load_topology

        topology = load_topology(args.topology)
        prefill = args.role == "prefill"
        pp = topology.prefill_pp if prefill else 1
        tp = topology.prefill_tp if prefill else topology.decode_tp
        stage0 = topology.stage_layers[0] if prefill else range(topology.model.num_layers)
        return RankClaim(
            pp,
            tp,
            f"the topology {args.topology} ({args.role}: PP {pp} x TP {tp})",
            topology.model.num_layers,
            stage0,
            from_topology=True,
        )
    if args.pp is None and args.tp is None:
        source = "none given: (pp 0, tp 0) only, which every engine serves (--pp/--tp for the rest)"
        return RankClaim(1, 1, source)
    pp, tp = args.pp or 1, args.tp or 1
    if pp < 1 or tp < 1:
        raise ValueError("--pp and --tp must be at least 1")
    source = f"--pp {pp} --tp {tp}"
    if args.num_layers is None:
        return RankClaim(pp, tp, source)
    if args.num_layers < pp:
        raise ValueError(f"--num-layers {args.num_layers} cannot fill --pp {pp} pipeline stages")
    return RankClaim(pp, tp, source, args.num_layers, pp_partition(args.num_layers, pp)[0])


def head_layers(region_members: Sequence[Sequence[str]]) -> list[int] | None:
    """The layer indices the head's regions hold (the first all-digit part of each name: model.layers.7.…
    is 7), sorted; None when the payload names no layer."""
    found = set()
    for members in region_members:
        for name in members:
            index = next((part for part in name.split(".") if part.isdecimal()), None)
            if index is not None:
                found.add(int(index))
    return sorted(found) if found else None


def _span(layers: Sequence[int]) -> str:
    if list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
    return f"layers {', '.join(map(str, layers))}"


def pipeline_refusal(claim: RankClaim, held: list[int] | None) -> tuple[str, str] | None:
    """(reason, message) when the head's payload contradicts the claimed pipeline or cannot confirm it; then
    no rank past (pp 0, tp 0) may be asked for. Pure."""
    if claim.pp == 1 and claim.tp == 1:
        return None
    if claim.tp > 1 and not claim.from_topology:
        # vLLM's listener dies on (0, 1) of a TP1 engine just as on (1, 0) of a PP1 one.
        return (
            "RanksUnconfirmed",
            f"nothing in the head's payload tells how many TP ranks the engine serves, so --tp {claim.tp} "
            "cannot be confirmed: give --topology (the operator's record of the engine) to ask for them",
        )
    if held is None:
        if claim.from_topology or claim.pp == 1:
            return None
        return (
            "RanksUnconfirmed",
            f"the head's payload names no layers, so nothing confirms that the engine has {claim.pp} "
            "pipeline stages: give --topology (the operator's record of the engine) to ask for the rest",
        )
    if claim.stage0 is None or claim.num_layers is None:
        if claim.pp == 1:
            return None
        return (
            "RanksUnconfirmed",
            f"the head (pp 0) holds {_span(held)}; whether that is stage 0 of {claim.pp} takes the model's "
            "layer count: give --num-layers (or --topology) to ask for the rest",
        )
    if held == list(claim.stage0):
        return None
    whole = held == list(range(claim.num_layers))
    actual = "every layer, so the engine is PP 1" if whole else _span(held)
    return (
        "PipelineSizeMismatch",
        f"the head (pp 0) holds {actual}, but PP {claim.pp} over {claim.num_layers} layers puts "
        f"{_span(list(claim.stage0))} on stage 0: the engine is not what {claim.source} says",
    )


def probe(args: argparse.Namespace) -> int:
    from disagg.worker.connector.side_channel import RankReply, fetch_payloads
    from disagg.worker.contracts.payload_facts import payload_facts
    from disagg.worker.kv import wire
    from disagg.worker.kv.errors import DisaggError

    def show(reply: RankReply) -> Any:
        facts = payload_facts(reply.payload)
        meta = wire.decode_handshake_payload(
            reply.payload, expected_hash=args.expect_hash, expected_engine_id=args.engine_id
        )
        lines = describe(
            reply.pp_rank, reply.tp_rank, facts.compatibility_hash, meta, reply.clock_offset_s, facts
        )
        print("\n".join(lines))
        return meta

    try:
        host, port = _split_target(args.target)
        claim = claimed_ranks(args)
        print(f"ranks: {claim.source}")
        # The head first, alone: its payload decides whether any other rank may be asked for.
        (head,) = fetch_payloads(host, port, [(0, 0)], timeout_s=args.timeout)
        meta = show(head)
        refused = pipeline_refusal(claim, head_layers(meta.region_members))
        if refused is not None:
            reason, message = refused
            print(f"probe {args.target} refused: {reason}: {message}; asked for (pp 0, tp 0) only")
            return 1
        for reply in fetch_payloads(host, port, claim.ranks[1:], timeout_s=args.timeout):
            show(reply)
    except DisaggError as exc:
        print(f"probe {args.target} failed: {exc.reason}: {exc.message}")
        return 1
    except ValueError as exc:
        print(f"probe {args.target} failed: InvalidArgument: {exc}")
        return 2
    return 0
