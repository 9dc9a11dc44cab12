"""Who is paired with whom: `pairing.routing_from_pods` over pods shaped as the API server serves them.

The pods are the operator's own templates for the pp2-hma example (a vLLM engine: watch mode, TP 2, PP 2),
named as their controllers name them, with the status and `disagg.io/kv-peers` annotation each case needs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.operator.api import DisaggDeploymentSpec
from disagg.operator.builders.children import build
from disagg.operator.kv_status import pod_kv
from disagg.operator.naming import Owner
from disagg.operator.policies.compat import evaluate
from disagg.worker.contracts.engine_pods import engine_pod, essentials
from disagg.worker.contracts.pairing import (
    DecodeTarget,
    Exclusion,
    PrefillTarget,
    Routing,
    routing_from_pods,
)
from disagg.worker.contracts.peer_report import (
    MAX_PEER_REPORT_BYTES,
    PEER_REPORT_VERSION,
    PeerReport,
    PeerVerdict,
    encode_peer_report,
)
from disagg.worker.contracts.pod_contract import (
    DEPLOYMENT_LABEL,
    DRAINING_ANNOTATION,
    PEER_REPORT_ANNOTATION,
    POD_CONDITION,
    ROUTER_COMPONENT,
    ROUTER_COMPONENT_LABEL,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pp2-hma.yaml"
HASH = "64207d5b90e0" + "0" * 52
OTHER_HASH = "9f1e2d3c4b5a" + "1" * 52
SUFFIX = "-1a2b3c4d"
ENGINE = "gemma-prefill-0"
STAGES = ("gemma-prefill-0-0", "gemma-prefill-0-1")
D1, D2 = "gemma-decode-7c9-abcde", "gemma-decode-7c9-fghij"
IPS = {STAGES[0]: "10.0.0.1", STAGES[1]: "10.0.0.2", D1: "10.0.0.3", D2: "10.0.0.4"}


def templates(deployment: str = "gemma") -> dict[str, dict[str, Any]]:
    spec = DisaggDeploymentSpec.model_validate(yaml.safe_load(EXAMPLE.read_text())["spec"])
    report = evaluate(spec)
    assert report.plan is not None
    objects = build(spec, Owner(deployment, "ns", "uid-1", 1), report.plan, report.hashes)
    return {
        obj["kind"]: obj["spec"]["template"]
        for obj in objects
        if obj["kind"] in ("StatefulSet", "Deployment") and obj["metadata"]["name"] != f"{deployment}-router"
    }


TEMPLATES = templates()


def pod(name: str, *, ready: bool = True, annotation: str | None = None) -> dict[str, Any]:
    kind = "StatefulSet" if "prefill" in name else "Deployment"
    template = copy.deepcopy(TEMPLATES[kind])
    metadata: dict[str, Any] = {**template["metadata"], "name": name, "namespace": "ns"}
    if annotation is not None:
        metadata["annotations"] = {PEER_REPORT_ANNOTATION: annotation}
    status = {
        "phase": "Running",
        "podIP": IPS.get(name, "10.0.1.9"),
        "conditions": [
            {"type": POD_CONDITION, "status": "True" if ready else "False"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": template["spec"],
        "status": status,
    }


def live(name: str) -> str:
    """A pod's live vLLM engine id: the stable id (a prefill pod's StatefulSet) and a per-start suffix."""
    return (ENGINE if name in STAGES else name) + SUFFIX


def verdict(
    peer: str, *, ok: bool = True, reason: str = "HandshakesSucceeded", kv_hash: str = HASH, differs: str = ""
) -> PeerVerdict:
    return PeerVerdict(pod=peer, engine_id=live(peer), ok=ok, reason=reason, kv_hash=kv_hash, differs=differs)


def report(name: str, *peers: PeerVerdict, kv_hash: str = HASH, engine_id: str | None = None) -> str:
    return encode_peer_report(
        PeerReport(
            version=PEER_REPORT_VERSION, engine_id=engine_id or live(name), kv_hash=kv_hash, peers=peers
        )
    )


def healthy() -> dict[str, dict[str, Any]]:
    """PP2 prefill + 2 decoders, each side vouching for the other."""
    decoders = (D1, D2)
    pods = {name: pod(name, annotation=report(name, *(verdict(d) for d in decoders))) for name in STAGES}
    pods |= {name: pod(name, annotation=report(name, *(verdict(s) for s in STAGES))) for name in decoders}
    return pods


def annotate(pods: dict[str, dict[str, Any]], name: str, value: str | None) -> None:
    annotations = pods[name]["metadata"].setdefault("annotations", {})
    if value is None:
        annotations.pop(PEER_REPORT_ANNOTATION, None)
    else:
        annotations[PEER_REPORT_ANNOTATION] = value


def excluded(routing: Routing) -> dict[tuple[str, str], Exclusion]:
    assert len(routing.pairs) + len(routing.exclusions) == len(routing.prefills) * len(routing.decodes)
    return {(e.prefill, e.decode): e for e in routing.exclusions}


def paired(routing: Routing) -> list[tuple[str, str]]:
    return [(pair.prefill.head_pod, pair.decode.pod) for pair in routing.pairs]


def test_a_pp2_prefill_and_two_decoders_that_vouch_for_each_other_are_two_pairs() -> None:
    routing = routing_from_pods(healthy().values())
    prefill = PrefillTarget(
        engine_id=ENGINE + SUFFIX,
        head_pod=STAGES[0],
        host="10.0.0.1",
        http_port=8000,
        side_channel_port=5600,
        tp_size=2,
        pp_size=2,
        stage_pods=STAGES,
        kv_hash=HASH,
    )
    decodes = tuple(DecodeTarget(d, d + SUFFIX, IPS[d], 8000, 2, HASH) for d in (D1, D2))
    assert routing.prefills == (prefill,)
    assert routing.decodes == decodes
    assert [(pair.prefill, pair.decode) for pair in routing.pairs] == [
        (prefill, decodes[0]),
        (prefill, decodes[1]),
    ]
    assert routing.exclusions == ()


def test_a_decoder_refused_for_its_hash_is_excluded_with_that_reason_and_the_others_stay_routable() -> None:
    pods = healthy()
    mismatch = "CompatibilityHashMismatch"
    for name in STAGES:
        annotate(
            pods, name, report(name, verdict(D1), verdict(D2, ok=False, reason=mismatch, kv_hash=OTHER_HASH))
        )
    refused = (verdict(s, ok=False, reason=mismatch) for s in STAGES)
    # Refused by every stage, its own readiness gate is False: the refusal is still the reason given.
    pods[D2] = pod(D2, ready=False, annotation=report(D2, *refused, kv_hash=OTHER_HASH))
    routing = routing_from_pods(pods.values())
    assert paired(routing) == [(STAGES[0], D1)]
    exclusion = excluded(routing)[(STAGES[0], D2)]
    assert exclusion.reason == mismatch
    assert STAGES[0] in exclusion.message and STAGES[1] in exclusion.message and D2 in exclusion.message
    assert f"decode pod {D2} reports {mismatch} from prefill stage 1 (pod {STAGES[1]})" in exclusion.message

    # One side's refusal is enough, whatever the other side says.
    pods = healthy()
    annotate(pods, D2, report(D2, verdict(STAGES[0]), verdict(STAGES[1], ok=False, reason="MissingLayers")))
    assert excluded(routing_from_pods(pods.values()))[(STAGES[0], D2)].reason == "MissingLayers"


def test_a_stage_pod_that_is_not_ready_takes_its_engine_out_of_every_pair() -> None:
    pods = healthy()
    pods[STAGES[1]]["status"]["conditions"][1]["status"] = "False"
    routing = routing_from_pods(pods.values())
    assert routing.pairs == ()
    for decode in (D1, D2):
        exclusion = excluded(routing)[(STAGES[0], decode)]
        assert exclusion.reason == "PodNotReady"
        assert f"prefill stage 1 (pod {STAGES[1]}) is not Ready" in exclusion.message
        assert decode in exclusion.message


def test_a_draining_pod_takes_no_new_request_and_says_so_whatever_its_report_says() -> None:
    pods = healthy()
    pods[D2]["metadata"]["annotations"][DRAINING_ANNOTATION] = "2026-12-01T09:00:00Z"
    routing = routing_from_pods(pods.values())
    assert paired(routing) == [(STAGES[0], D1)]
    exclusion = excluded(routing)[(STAGES[0], D2)]
    assert exclusion.reason == "Draining"
    assert f"decode pod {D2} is draining" in exclusion.message

    # A draining stage takes its whole engine out; a pod being deleted is PodNotReady, draining or not.
    pods = healthy()
    pods[STAGES[1]]["metadata"]["annotations"][DRAINING_ANNOTATION] = "2026-12-01T09:00:00Z"
    pods[D1]["metadata"]["annotations"][DRAINING_ANNOTATION] = "2026-12-01T09:00:00Z"
    pods[D1]["metadata"]["deletionTimestamp"] = "2026-12-01T09:00:05Z"
    reasons = {key: e.reason for key, e in excluded(routing_from_pods(pods.values())).items()}
    assert reasons == {(STAGES[0], D1): "PodNotReady", (STAGES[0], D2): "Draining"}


def test_a_pod_being_deleted_without_an_ip_or_missing_is_not_ready_whatever_its_report_says() -> None:
    pods = healthy()
    pods[D1]["metadata"]["deletionTimestamp"] = "2026-12-01T09:00:00Z"
    del pods[D2]["status"]["podIP"]
    routing = routing_from_pods(pods.values())
    assert routing.pairs == ()
    assert "is being deleted" in excluded(routing)[(STAGES[0], D1)].message
    assert "has no IP yet" in excluded(routing)[(STAGES[0], D2)].message
    assert {e.reason for e in routing.exclusions} == {"PodNotReady"}

    pods = healthy()
    del pods[STAGES[0]]
    routing = routing_from_pods(pods.values())
    assert [p.head_pod for p in routing.prefills] == [STAGES[0]], "named after the head it will have"
    assert routing.prefills[0].host == ""
    assert excluded(routing)[(STAGES[0], D1)].reason == "PodNotReady"
    assert f"prefill stage 0 of engine {ENGINE} has no pod" in excluded(routing)[(STAGES[0], D1)].message


def test_a_missing_garbled_or_oversize_annotation_excludes_its_pairs_with_a_clear_reason() -> None:
    cases = {
        None: ("NotYetChecked", f"decode pod {D1} has not reported its peer checks yet"),
        "{not json": ("InvalidPeerReport", f"decode pod {D1} has an invalid {PEER_REPORT_ANNOTATION}"),
        json.dumps({"version": 9, "engineId": "e", "kvHash": ""}): ("InvalidPeerReport", "version 9"),
        " " * (MAX_PEER_REPORT_BYTES + 1): ("InvalidPeerReport", "exceeds"),
    }
    for value, (reason, words) in cases.items():
        pods = healthy()
        annotate(pods, D1, value)
        routing = routing_from_pods(pods.values())
        assert paired(routing) == [(STAGES[0], D2)]
        exclusion = excluded(routing)[(STAGES[0], D1)]
        assert (exclusion.reason, words in exclusion.message) == (reason, True), exclusion.message


def test_a_peer_not_yet_checked_by_one_side_is_not_routable() -> None:
    pods = healthy()
    annotate(pods, D1, report(D1, verdict(STAGES[0])))
    annotate(pods, STAGES[0], report(STAGES[0], verdict(D2)))
    exclusion = excluded(routing_from_pods(pods.values()))[(STAGES[0], D1)]
    assert exclusion.reason == "NotYetChecked"
    assert f"decode pod {D1} has not checked prefill stage 1 (pod {STAGES[1]}) yet" in exclusion.message
    assert f"prefill stage 0 (pod {STAGES[0]}) has not checked decode pod {D1} yet" in exclusion.message


def test_ok_verdicts_with_differing_hashes_are_not_routable() -> None:
    pods = healthy()
    # Every verdict is ok (an engine not enforcing the hash), but D1 advertises another hash than was seen.
    annotate(pods, D1, report(D1, *(verdict(s) for s in STAGES), kv_hash=OTHER_HASH))
    routing = routing_from_pods(pods.values())
    assert paired(routing) == [(STAGES[0], D2)]
    exclusion = excluded(routing)[(STAGES[0], D1)]
    assert exclusion.reason == "HashDiffers"
    assert f"decode pod {D1} advertises compatibility hash {OTHER_HASH[:12]}" in exclusion.message

    pods = healthy()
    annotate(pods, D2, report(D2, verdict(STAGES[0]), verdict(STAGES[1], kv_hash=OTHER_HASH)))
    assert excluded(routing_from_pods(pods.values()))[(STAGES[0], D2)].reason == "HashDiffers"


def test_pairing_uses_the_live_engine_id_and_a_verdict_on_a_restarted_engine_vouches_for_nothing() -> None:
    pods = healthy()
    restarted = D1 + "-99999999"
    annotate(pods, D1, report(D1, *(verdict(s) for s in STAGES), engine_id=restarted))
    routing = routing_from_pods(pods.values())
    assert routing.decodes[0].engine_id == restarted
    exclusion = excluded(routing)[(STAGES[0], D1)]
    assert exclusion.reason == "NotYetChecked"
    assert (
        f"checked engine {D1 + SUFFIX} of decode pod {D1}, which now runs engine {restarted}"
        in exclusion.message
    )
    assert paired(routing) == [(STAGES[0], D2)]


def test_pods_of_other_roles_and_deployments_are_not_paired_across() -> None:
    pods = list(healthy().values())
    router = pod(D1)
    router["metadata"]["name"] = "gemma-router-5d8-xyz"
    router["metadata"]["labels"] = {DEPLOYMENT_LABEL: "gemma", ROUTER_COMPONENT_LABEL: ROUTER_COMPONENT}
    stranger = pod(D1)
    stranger["metadata"]["name"] = "other-decode-1-aaaaa"
    stranger["metadata"]["labels"] = {**stranger["metadata"]["labels"], DEPLOYMENT_LABEL: "other"}
    routing = routing_from_pods([*pods, router, stranger, {"metadata": {"name": "plain"}}])
    assert paired(routing) == [(STAGES[0], D1), (STAGES[0], D2)]
    assert [d.pod for d in routing.decodes] == [D1, D2, "other-decode-1-aaaaa"]
    assert all(e.decode != "other-decode-1-aaaaa" or e.prefill != STAGES[0] for e in routing.exclusions)
    assert routing.exclusions == (), "a deployment with no prefill engine has no pairs to exclude"


pod_fields = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=150)
@given(
    annotation=st.text(max_size=300) | pod_fields.map(json.dumps),
    target=st.sampled_from((*STAGES, D1)),
    field=st.sampled_from(
        ("metadata", "spec", "status", "labels", "annotations", "conditions", "containers")
    ),
    junk=pod_fields,
)
def test_hostile_annotations_and_odd_pods_never_raise(
    annotation: str, target: str, field: str, junk: Any
) -> None:
    pods = healthy()
    annotate(pods, target, annotation)
    routing = routing_from_pods(pods.values())
    assert all(
        target not in (prefill, *routing.prefills[0].stage_pods, decode)
        for prefill, decode in paired(routing)
    )
    broken = copy.deepcopy(pods[D2])
    where = {
        "labels": broken["metadata"],
        "annotations": broken["metadata"],
        "conditions": broken["status"],
        "containers": broken["spec"],
    }.get(field, broken)
    where[field] = junk
    everything = [*pods.values(), broken, junk]
    routing = routing_from_pods(everything)
    # What the operator's index and the router's cache hold of each pod pairs exactly as the pod does.
    kept = [essentials(each) if isinstance(each, dict) else each for each in everything]
    assert routing_from_pods(kept) == routing


def test_a_pods_essentials_pair_read_and_report_as_the_pod_at_a_fraction_of_its_size() -> None:
    pods = healthy()
    pods[D2]["status"]["conditions"][0] = {
        "type": POD_CONDITION,
        "status": "False",
        "reason": "CompatibilityHashMismatch",
        "message": "prefill stage 1 differs",
    }
    pods[STAGES[1]]["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    pods[D1]["status"].pop("podIP")
    for each in pods.values():
        each["metadata"]["managedFields"] = [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}] * 20
    kept = {name: essentials(each) for name, each in pods.items()}
    assert routing_from_pods(kept.values()) == routing_from_pods(pods.values())
    for name, each in pods.items():
        assert engine_pod(kept[name]) == engine_pod(each)
        assert pod_kv(kept[name]) == pod_kv(each)
        assert len(json.dumps(kept[name])) * 4 < len(json.dumps(each))


def test_container_restarts_reach_the_targets_and_survive_the_essentials() -> None:
    pods = healthy()
    pods[STAGES[1]]["status"]["containerStatuses"] = [
        {"name": "engine", "restartCount": 2, "image": "x", "state": {"running": {}}},
        {"name": "sidecar", "restartCount": 1},
    ]
    pods[D2]["status"]["containerStatuses"] = [
        {"name": "engine", "restartCount": True},
        {"restartCount": "3"},
    ]
    for source in (pods.values(), [essentials(each) for each in pods.values()]):
        routing = routing_from_pods(source)
        assert {pair.prefill.restarts for pair in routing.pairs} == {3}
        # Only whole counts count: a boolean or a string is no restart.
        assert {pair.decode.pod: pair.decode.restarts for pair in routing.pairs} == {D1: 0, D2: 0}
    assert "image" not in json.dumps(essentials(pods[STAGES[1]]))


def test_during_a_rolling_version_change_old_pairs_with_old_and_new_with_new() -> None:
    old, new = ("gemma-prefill-0-0", "gemma-prefill-0-1"), ("gemma-prefill-1-0", "gemma-prefill-1-1")
    ids = {"gemma-prefill-0": "gemma-prefill-0" + SUFFIX, "gemma-prefill-1": "gemma-prefill-1-5e6f7a8b"}
    hashes = {D1: HASH, D2: OTHER_HASH, **dict.fromkeys(old, HASH), **dict.fromkeys(new, OTHER_HASH)}

    def engine(name: str) -> str:
        return ids[name.rsplit("-", 1)[0]] if "prefill" in name else name + SUFFIX

    def seen(judge: str, peer: str) -> PeerVerdict:
        ok = hashes[judge] == hashes[peer]
        reason = "HandshakesSucceeded" if ok else "CompatibilityHashMismatch"
        return PeerVerdict(pod=peer, engine_id=engine(peer), ok=ok, reason=reason, kv_hash=hashes[peer])

    def reporting(name: str, peers: tuple[str, ...]) -> dict[str, Any]:
        body = PeerReport(
            version=PEER_REPORT_VERSION,
            engine_id=engine(name),
            kv_hash=hashes[name],
            peers=tuple(seen(name, peer) for peer in peers),
        )
        return pod(name, annotation=encode_peer_report(body))

    pods = [reporting(name, (D1, D2)) for name in (*old, *new)]
    pods += [reporting(name, (*old, *new)) for name in (D1, D2)]
    routing = routing_from_pods(pods)
    assert [(p.prefill.head_pod, p.prefill.engine_id, p.decode.pod) for p in routing.pairs] == [
        (old[0], ids["gemma-prefill-0"], D1),
        (new[0], ids["gemma-prefill-1"], D2),
    ]
    assert [(e.prefill, e.decode, e.reason) for e in routing.exclusions] == [
        (old[0], D2, "CompatibilityHashMismatch"),
        (new[0], D1, "CompatibilityHashMismatch"),
    ]


def test_an_exclusion_for_a_hash_names_what_the_sidecar_found_different() -> None:
    pods = healthy()
    dtype = "the KV dtype (dtype, or cache_dtype where set), likely, by block_lens"
    refused = (verdict(s, ok=False, reason="CompatibilityHashMismatch", differs=dtype) for s in STAGES)
    pods[D2] = pod(D2, annotation=report(D2, *refused, kv_hash=OTHER_HASH))
    exclusion = excluded(routing_from_pods(pods.values()))[(STAGES[0], D2)]
    assert exclusion.reason == "CompatibilityHashMismatch"
    assert f"; they differ in {dtype})" in exclusion.message
