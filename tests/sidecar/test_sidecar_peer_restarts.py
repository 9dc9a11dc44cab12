"""Decoders that die or restart do not stay in a prefill sidecar (issue 22, finding 5): over 20 decoder
kill cycles the prefill's RSS stays flat, each dead decoder is evicted with its reason, a decoder restarted
under its old engine id is reconnected rather than written through a stale agent, and a live idle decoder
is kept."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from sidecar_procs import KVShape, SidecarProcess, metric
from test_sidecar_hostile import proc_rss

from disagg.worker.kv.layout import ModelGeometry
from disagg.worker.link.engine_link import (
    EngineLink,
    KVReady,
    KVSent,
    PrefillEngine,
)
from disagg.worker.link.kv_pool import ShmPool

CYCLES = 20
WARM_UP = 5
PREFILL_ID = "restarts-prefill"
# A KV large enough that a dead decoder's descriptors show in RSS (~3 MiB each before the fix).
KV = KVShape(ModelGeometry.with_full_every(32, 1, num_kv_heads=2, head_size=8, dtype_bytes=2), 16, 4096)
PROBE = {"DISAGG_PEER_PROBE_INTERVAL_S": "0.5"}


class Decoder:
    """A decode sidecar with its engine's pool registered."""

    def __init__(
        self, workdir: Path, sidecars: list[SidecarProcess], engine_id: str, name: str, **env: str
    ) -> None:
        folder = workdir / name
        folder.mkdir()
        self.sidecar = SidecarProcess(
            folder, "d", KV.topology(), DISAGG_ROLE="decode", DISAGG_ENGINE_ID=engine_id, **PROBE, **env
        )
        self.side_channel_port = int(env.get("DISAGG_SIDE_CHANNEL_PORT", self.sidecar.side_channel_port))
        sidecars.append(self.sidecar)
        self.sidecar.wait_listening()
        self.pool = ShmPool.create(folder / "d.kv", KV.stage_layout().total_bytes)
        self.link = EngineLink(self.sidecar.socket_path).__enter__()
        self.link.register_layout(KV.registration(self.pool, engine_id, "decode"))

    def kill(self) -> None:
        self.link.__exit__(None, None, None)
        self.sidecar.kill()
        self.pool.close()
        self.pool.path.unlink(missing_ok=True)


def transfer(p_link: EngineLink, decoder: Decoder, source: PrefillEngine, request_id: str) -> None:
    groups = len(KV.stage_layout().groups)
    decoder.link.expect_request(request_id, [[g + 1] for g in range(groups)], source)
    p_link.request_finished(request_id, [[g + 2] for g in range(groups)])
    assert isinstance(p_link.wait(request_id, timeout_s=60), KVSent)
    assert isinstance(decoder.link.wait(request_id, timeout_s=60), KVReady)


def evictions(prefill: SidecarProcess) -> list[tuple[str, str]]:
    found = re.findall(
        r'"msg": "peer engine evicted", "engine_id": "([^"]+)", "reason": "([^"]+)"',
        prefill.log_path.read_text(errors="replace"),
    )
    return [(engine_id, reason) for engine_id, reason in found]


def wait_for(predicate: Any, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not after {timeout_s} s: {what}"
        time.sleep(0.2)


def test_killed_decoders_are_evicted_and_the_prefill_rss_stays_flat(
    workdir: Path, sidecars: list[SidecarProcess]
) -> None:
    prefill = SidecarProcess(
        workdir,
        "p",
        KV.topology(),
        DISAGG_ROLE="prefill",
        DISAGG_ENGINE_ID=PREFILL_ID,
        DISAGG_PP_RANK="0",
        **PROBE,
    )
    sidecars.append(prefill)
    prefill.wait_listening()
    p_pool = ShmPool.create(workdir / "p.kv", KV.stage_layout().total_bytes)
    source = PrefillEngine(PREFILL_ID, "127.0.0.1", prefill.side_channel_port)
    rss: list[int] = []
    with EngineLink(prefill.socket_path) as p_link:
        p_link.register_layout(KV.registration(p_pool, PREFILL_ID, "prefill"))
        live = Decoder(workdir, sidecars, "live-decoder", "live")
        transfer(p_link, live, source, "live-r0")
        for cycle in range(CYCLES):
            decoder = Decoder(workdir, sidecars, f"killed-{cycle}", f"c{cycle}")
            for r in range(2):
                transfer(p_link, decoder, source, f"c{cycle}-r{r}")
            decoder.kill()
            if cycle == WARM_UP - 1:
                # By now the probe threads have all run (each with its own malloc arena): what grows from
                # here is what is kept.
                wait_for(lambda: len(evictions(prefill)) >= WARM_UP, "the first dead decoders evicted")
                rss.append(proc_rss(prefill.proc.pid))
        wait_for(lambda: len(evictions(prefill)) >= CYCLES, f"{CYCLES} dead decoders evicted")
        rss.append(proc_rss(prefill.proc.pid))

        # A decoder restarted under its old engine id and address (a container restart keeps both) is
        # reconnected: its first request is not written through the dead process's agent.
        first = Decoder(workdir, sidecars, "same-id", "same1")
        transfer(p_link, first, source, "same-r0")
        first.kill()
        port = str(first.side_channel_port)
        second = Decoder(workdir, sidecars, "same-id", "same2", DISAGG_SIDE_CHANNEL_PORT=port)
        wait_for(lambda: ("same-id", "PeerRestarted") in evictions(prefill), "the restart noticed")
        transfer(p_link, second, source, "same-r1")

        # The live decoder sat idle through every probe above: never evicted, no new handshake.
        transfer(p_link, live, source, "live-r1")
        text = prefill.get("/metrics")[1]
    log = prefill.log_path.read_text(errors="replace")
    evicted = evictions(prefill)
    growth = (rss[-1] - rss[0]) / 2**20
    print(
        f"\n{CYCLES} decoder kill cycles: prefill RSS after cycle {WARM_UP} {rss[0] / 2**20:.1f} MiB, "
        f"after the last {rss[-1] / 2**20:.1f} MiB ({growth:+.1f} MiB); "
        f"evictions {sorted({reason for _, reason in evicted})}"
    )
    killed = {f"killed-{cycle}" for cycle in range(CYCLES)}
    assert {engine_id for engine_id, _ in evicted if engine_id in killed} == killed
    assert all(reason == "PeerUnreachable" for engine_id, reason in evicted if engine_id in killed)
    assert "live-decoder" not in {engine_id for engine_id, _ in evicted}
    assert log.count('"peer engine connected", "engine_id": "live-decoder"') == 1
    assert metric(text, "disagg_peer_engines") == 2  # the live decoder and the restarted one
    assert metric(text, "disagg_peer_engine_evictions_total", reason="PeerUnreachable") == CYCLES
    # Without evictions each dead decoder kept its agents and descriptors (~3 MiB here with one descriptor
    # row per block). Heap layout alone moves this figure by up to ~12 MiB between runs.
    assert growth < 20, f"prefill RSS grew {growth:.1f} MiB over {CYCLES - WARM_UP} decoder kill cycles"
    second.kill()
    live.kill()
    assert prefill.terminate() == 0
    p_pool.close()
