"""What `disagg engine serve` is configured with (`ServeSettings`), and the tiny model its topology describes.

Both are read before anything starts: the command line checks `model_config` to refuse a bad configuration
(exit 2) before it serves, and the head and a headless stage each build their model from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.worker.contracts.topology import Role, Topology
from disagg.worker.engine.config import TinyConfig
from disagg.worker.kv.errors import DisaggError, WorkerConfigError


@dataclass(frozen=True)
class ServeSettings:
    """Everything `disagg engine serve` needs: its flags and what `sidecar.config.from_env` read."""

    role: Role
    engine_id: str
    pp_rank: int
    pp_size: int
    tp_size: int
    advertised_host: str
    """`remote_host` of a prefill response: where the engine's side channel answers (its head)."""
    advertised_port: int
    engine_socket: str
    kv_pool: str
    topology: Topology
    model_name: str
    host: str = "0.0.0.0"
    port: int = 8000
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    num_blocks: int = 1024

    @property
    def headless(self) -> bool:
        return self.role == "prefill" and self.pp_rank > 0


def model_config(topology: Topology, role: Role) -> TinyConfig:
    """The tiny model the topology describes; `WorkerConfigError` when it describes another model."""
    geometry = topology.model
    try:
        config = TinyConfig(
            num_layers=len(geometry.kinds),
            num_kv_heads=geometry.num_kv_heads,
            head_size=geometry.head_size,
            block_size=topology.block_size,
        )
    except DisaggError as exc:
        raise WorkerConfigError(
            f"the reference engine cannot serve the topology's model: {exc.message}"
        ) from None
    if config.geometry != geometry:
        raise WorkerConfigError(
            f"the reference engine serves {config.geometry}, the topology's model is {geometry}"
        )
    if role == "prefill" and tuple(config.stages(topology.prefill_pp)) != tuple(topology.stage_layers):
        raise WorkerConfigError(
            f"the reference engine splits layers evenly ({config.stages(topology.prefill_pp)}), the "
            f"topology's stages are {list(topology.stage_layers)}"
        )
    if topology.prefill_tp != 1 or topology.decode_tp != 1 or topology.packed:
        raise WorkerConfigError("the reference engine runs TP 1 with layer-outer (not packed) pools")
    return config
