"""`disagg router run`'s flags: each client bound and backpressure setting is a flag, its default is the
router's, and the value reaches the router's config."""

from __future__ import annotations

import argparse
import dataclasses

from disagg.worker.router.cli import config_from, register
from disagg.worker.router.config import RouterConfig

REQUIRED = ["router", "run", "--deployment", "d", "--namespace", "n"]


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="disagg")
    register(parser.add_subparsers())
    return parser.parse_args([*REQUIRED, *flags])


def test_the_defaults_are_the_routers() -> None:
    assert config_from(parse()) == RouterConfig()


def test_every_bound_is_a_flag_that_reaches_the_config() -> None:
    flags = {
        "--max-connections": ("max_connections", "7"),
        "--header-timeout-s": ("header_timeout_s", "1.5"),
        "--body-timeout-s": ("body_timeout_s", "2.5"),
        "--max-request-bytes": ("max_request_bytes", "1000"),
        "--max-body-buffer-bytes": ("max_body_buffer_bytes", "5000"),
        "--request-timeout-s": ("request_timeout_s", "9"),
        "--max-in-flight-per-decoder": ("max_in_flight_per_decoder", "3"),
        "--max-queued": ("max_queued", "4"),
        "--queue-timeout-s": ("queue_timeout_s", "0.5"),
        "--retry-after-s": ("retry_after_s", "6"),
        "--stall-timeout": ("stall_timeout_s", "11"),
        "--load-poll-s": ("load_poll_s", "0.25"),
        "--decoder-headroom": ("decoder_headroom", "3"),
        "--decoder-headroom-fraction": ("decoder_headroom_fraction", "0.5"),
        "--min-body-rate-bytes-s": ("min_body_rate_bytes_s", "100"),
        "--body-rate-grace-s": ("body_rate_grace_s", "0.25"),
        "--eject-after-failures": ("eject_after_failures", "5"),
        "--eject-s": ("eject_s", "2.5"),
        "--max-eject-s": ("max_eject_s", "30"),
    }
    config = config_from(parse(*(x for flag, (_, value) in flags.items() for x in (flag, value))))
    for flag, (field, value) in flags.items():
        assert getattr(config, field) == type(getattr(RouterConfig(), field))(value), flag
    untouched = {f.name for f in dataclasses.fields(RouterConfig)} - {field for field, _ in flags.values()}
    for field in untouched - {"prefill_timeout_s", "decode_timeout_s"}:
        assert getattr(config, field) == getattr(RouterConfig(), field), field
