"""`builders.topology`: the topology ConfigMap carries the plan, and the sidecar reads it."""

from __future__ import annotations

import json

from built import objects
from dd_specs import spec

from disagg.operator.builders.topology import TOPOLOGY_KEY
from disagg.operator.policies.compat import evaluate
from disagg.worker.contracts.topology import decode_topology


class TestTopologyConfigMap:
    def test_topology_configmap_carries_the_plan_and_hashes(self) -> None:
        model = spec()
        report = evaluate(model)
        document = json.loads(objects(model)["ConfigMap", "gemma-pp2-topology"]["data"][TOPOLOGY_KEY])
        assert report.plan is not None
        assert document["stages"] == report.plan.to_dict()["stages"]
        assert document["compatibilityHashes"] == dict(report.hashes)
        assert [s["endLayer"] - s["startLayer"] for s in document["stages"]] == [31, 31]
        assert document["blockSize"] == 32 and document["kvLeaseDurationSeconds"] == 120
        kinds = document["model"]["layerKinds"]
        assert len(kinds) == 62 and kinds[:6] == ["sliding_window"] * 5 + ["full"]
        assert document["model"]["numKVHeads"] == 16 and document["model"]["dtypeBytes"] == 2

    def test_the_sidecar_accepts_the_topology_document(self) -> None:
        document = objects(spec())["ConfigMap", "gemma-pp2-topology"]["data"][TOPOLOGY_KEY]
        topology = decode_topology(json.loads(document))
        assert topology.block_size == 32
