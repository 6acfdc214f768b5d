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
    """Machine and the vector ISA torch's CPU kernels (and AOTInductor's generated code) use here."""
    import torch
    try:
        caps = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older builds lack the query
        caps = "unknown"
    return f"{platform.machine()}-{caps}"
