"""Cross-release decode matrix: each release's own typed decoders on every release's golden vectors.

    PYTHONSAFEPATH=1 .venv-vllm/bin/python hack/vllm/cross_decode.py        # writes tests/golden/vllm/cross_decode.json

The driver runs itself once per release (0.33.0 from the venv, others with PYTHONPATH=<extracted wheel>, default
~/.cache/disagg/vllm-wheels/x/<version>; override with VLLM_EXTRACTED_ROOT) with --worker, which decodes every
agent_metadata_*.msgpack and handshake_payload_*.msgpack under tests/golden/vllm/*/ with
msgspec.msgpack.Decoder(NixlAgentMetadata / NixlHandshakePayload) of that release, re-encodes with
msgspec.msgpack.Encoder(), and reports: ok / error, fields filled from defaults, unknown keys dropped, and whether
the re-encoding is byte-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GOLDEN = ROOT / "tests" / "golden" / "vllm"


def worker() -> None:
    import msgspec

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as M

    fields = list(M.NixlAgentMetadata.__dataclass_fields__)
    dec = msgspec.msgpack.Decoder(M.NixlAgentMetadata)
    pdec = msgspec.msgpack.Decoder(M.NixlHandshakePayload)
    enc = msgspec.msgpack.Encoder()
    out = []
    for d in sorted(p for p in GOLDEN.iterdir() if p.is_dir()):
        for f in sorted(d.glob("agent_metadata_*.msgpack")) + sorted(d.glob("handshake_payload_*.msgpack")):
            data = f.read_bytes()
            row = {"vector": f"{d.name}/{f.name}"}
            try:
                if f.name.startswith("handshake_payload_"):
                    p = pdec.decode(data)
                    row["payload_ok"] = True
                    data = p.agent_metadata_bytes
                meta = dec.decode(data)
                keys = list(msgspec.msgpack.decode(data).keys())
                row.update(
                    ok=True,
                    filled_from_defaults=[k for k in fields if k not in keys],
                    unknown_keys_dropped=[k for k in keys if k not in fields],
                    reencode_identical=enc.encode(meta) == data,
                )
            except Exception as e:
                row.update(ok=False, error=f"{type(e).__name__}: {e}")
            out.append(row)
    print(
        json.dumps(
            {
                "decoder_release": vllm.__version__,
                "connector_version": M.NIXL_CONNECTOR_VERSION,
                "module": M.__file__,
                "results": out,
            }
        )
    )


def main() -> int:
    root = Path(os.environ.get("VLLM_EXTRACTED_ROOT", "~/.cache/disagg/vllm-wheels/x")).expanduser()
    versions = sorted(p.name for p in GOLDEN.iterdir() if p.is_dir())
    import vllm as installed  # the venv's release runs without PYTHONPATH

    matrix = []
    for v in versions:
        env = dict(os.environ, PYTHONSAFEPATH="1", VLLM_TARGET_DEVICE="cpu")
        if v != installed.__version__:
            if not (root / v / "vllm").is_dir():
                print(f"cross_decode.py: no extracted wheel for {v} under {root}; skipped", file=sys.stderr)
                continue
            env["PYTHONPATH"] = str(root / v)
        r = subprocess.run(
            [sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, check=True
        )
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["module"] = res["module"].replace(str(root), "$VLLM_EXTRACTED_ROOT")
        if v == installed.__version__:
            res["module"] = "(pip-installed in .venv-vllm) " + res["module"].split("site-packages/")[-1]
        matrix.append(res)
    summary = {}
    for m in matrix:
        for r in m["results"]:
            summary.setdefault(r["vector"], {})[m["decoder_release"]] = (
                ("ok" if r.get("reencode_identical") else "ok, re-encoding differs") if r["ok"] else "error"
            )
    (GOLDEN / "cross_decode.json").write_text(
        json.dumps(
            {
                "kind": "cross_decode",
                "how": __doc__.strip().splitlines()[0],
                "summary": summary,
                "matrix": matrix,
            },
            indent=2,
        )
        + "\n"
    )
    print(
        f"cross_decode.py: {len(matrix)} decoders x {len(summary)} vectors -> {GOLDEN / 'cross_decode.json'}"
    )
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        sys.exit(main())
