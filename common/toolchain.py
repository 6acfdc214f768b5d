"""What a compiled file is tied to on this machine (imports torch lazily; the rest of common/ is stdlib only)."""

from __future__ import annotations

import platform


def cpu_isa() -> str:
    """Machine and the vector ISA torch's CPU kernels (and AOTInductor's generated code) use here."""
    import torch
    try:
        caps = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older builds lack the query
        caps = "unknown"
    return f"{platform.machine()}-{caps}"
