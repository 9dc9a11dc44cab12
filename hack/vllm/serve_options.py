"""Write the option table of the release's `vllm serve` parser, which the operator's engine-argument check is
judged against (tests/unit/test_engine_args_vllm.py): whether argparse abbreviations are on, and every option
string with the action it belongs to.

    bash hack/vllm/venv.sh
    PYTHONSAFEPATH=1 .venv-vllm/bin/python hack/vllm/serve_options.py   # tests/golden/vllm/serve_options.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import vllm  # noqa: E402
from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "golden" / "vllm" / "serve_options.json"


def main() -> int:
    parser = FlexibleArgumentParser()
    serve = ServeSubcommand().subparser_init(parser.add_subparsers())
    actions: dict[int, dict[str, object]] = {}
    for option, action in serve._option_string_actions.items():
        entry = actions.setdefault(
            id(action),
            {"dest": action.dest, "nargs": action.nargs, "kind": type(action).__name__, "option_strings": []},
        )
        entry["option_strings"].append(option)  # type: ignore[union-attr]
    table = sorted(
        ({**entry, "option_strings": sorted(entry["option_strings"])} for entry in actions.values()),  # type: ignore[arg-type]
        key=lambda entry: str(entry["dest"]),
    )
    document = {
        "generator": "hack/vllm/serve_options.py",
        "vllm_version": vllm.__version__,
        "python": sys.version.split()[0],
        "allow_abbrev": serve.allow_abbrev,
        "prefix_chars": serve.prefix_chars,
        "actions": table,
    }
    OUT.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {OUT}: {len(table)} actions of vllm {vllm.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
