"""What a compiled file is tied to on this machine (imports torch lazily; the rest of common/ is stdlib only)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def default_cache_dir() -> Path:
    """Where compiled graphs (compile) and measured kernel choices (runtime) are cached: $DEEPINFER_CACHE, else
    $XDG_CACHE_HOME/deepinfer, else ~/.cache/deepinfer."""
    env = os.environ.get("DEEPINFER_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deepinfer"


def cpu_isa() -> str:
    """Machine and the vector ISA torch's CPU kernels (and AOTInductor's generated code) use here. On AVX-512,
    also the extensions Inductor compiles for where the CPU has them (-mavx512bf16, -mamx-*): a graph built on an
    AMX host would stop with an illegal instruction on an AVX-512 host without AMX, which "AVX512" alone let through.
    Read from the CPU (cpuinfo), not by compiling probes, so a run-only host needs no compiler."""
    import torch
    try:
        caps = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older builds lack the query
        caps = "unknown"
    if caps.startswith("AVX512"):
        for name, flag in (("_is_avx512_vnni_supported", "vnni"), ("_is_avx512_bf16_supported", "bf16"),
                           ("_is_amx_tile_supported", "amx")):
            probe = getattr(torch.cpu, name, None)
            try:
                if probe is not None and probe():
                    caps += f"+{flag}"
            except Exception:   # a build without the query
                pass
    return f"{platform.machine()}-{caps}"
