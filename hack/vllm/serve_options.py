"""Write worker/contracts/vllm_serve_options.py: every supported vLLM release's `vllm serve` option table,
read from the release's own parser by the vLLM test peer (hack/vllm/peer_server.py, op `serve_options`).

    bash hack/vllm/venv.sh && bash hack/vllm/wheels.sh          # the peers' .venv-vllm and extracted wheels
    PYTHONSAFEPATH=1 .venv/bin/python hack/vllm/serve_options.py

Runs in the project venv; the peers run each release. tests/interop/test_serve_options_interop.py fails when
the shipped table differs from what the releases say.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "worker" / "contracts" / "vllm_serve_options.py"
COMMAND = "PYTHONSAFEPATH=1 .venv/bin/python hack/vllm/serve_options.py"
sys.path.insert(0, str(ROOT / "tests" / "interop"))

from _vllm_peer import RELEASES, VllmPeer  # noqa: E402

HEADER = f'''"""The option table of each supported vLLM release's `vllm serve` parser. Generated: do not edit.

Written by `{COMMAND}` from each release's own parser
(the vLLM test peers, CPython @PYTHON@); tests/interop/test_serve_options_interop.py fails when it is stale.
`vllm_serve_argv` reads it.

Per release (the version its wheel was read from): whether argparse abbreviations are on, the positionals'
nargs (`vllm serve [model_tag]`), and one line per action: its nargs ("0", "1", "?", "*", "+", a count, or
"exit" for help), with "o" appended when its value may be a JSON object (so vLLM's dotted keys of it parse),
then how its type and choices judge a value where they do ("=", "?" when "" and "None" read as None, the type:
int, float, str, json, hint or hint-auto for vLLM's human-readable integers, lower_ for its lower-cased
choices; ":" and the choices as JSON), then every option string the parser registered (`--no-` negations and
vLLM's `--enable-`/`--disable-` pairs included; underscore spellings are vLLM's rewriting, not options).
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

SERVE_OPTIONS: Final[Mapping[str, tuple[bool, tuple[str, ...], tuple[str, ...]]]] = MappingProxyType(
    {{
'''


def render(tables: dict[str, dict[str, Any]], python: str) -> str:
    lines = [HEADER.replace("@PYTHON@", python)]
    for release, table in tables.items():
        positionals = "".join(f"{json.dumps(n)}, " for n in table["positionals"])
        lines.append(f"        {json.dumps(release)}: (\n")
        lines.append(f"            {table['allow_abbrev']},\n")
        lines.append(f"            ({positionals.rstrip()}),\n")
        lines.append("            (\n")
        lines += [f"                {json.dumps(line)},\n" for line in table["actions"]]
        lines.append("            ),\n")
        lines.append("        ),\n")
    lines.append("    }\n)\n")
    return "".join(lines)


def main() -> int:
    tables: dict[str, dict[str, Any]] = {}
    python = ""
    with tempfile.TemporaryDirectory() as scratch:
        for release in RELEASES:
            peer = VllmPeer(release, Path(scratch) / f"peer-{release}.log", Path(scratch) / "hf")
            try:
                tables[release] = peer.call("serve_options")
                python = peer.call("python_version")
            finally:
                peer.close()
    OUT.write_text(render(tables, python), encoding="utf-8")
    subprocess.run([str(Path(sys.executable).parent / "ruff"), "format", "-q", str(OUT)], check=True)
    counts = {release: len(table["actions"]) for release, table in tables.items()}
    print(f"wrote {OUT.relative_to(ROOT)}: actions per release {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
