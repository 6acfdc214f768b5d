"""Turn one exported graph into the backend's compiled file, through a content-addressed cache."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.errors import BackendUnavailable
from ..common.manifest import NEURON_PENDING, Toolchain, sha256_file
from ..common.toolchain import cpu_isa

# What each backend writes next to the canonical exported program (graphs/<name>.ep.pt2).
SUFFIX = {"cpu": ".aoti.pt2", "eager": None, "cuda": None, "neuron": None}   # neuron: NEFFs in phase 2


def toolchain(backend: str, neuron_target: str | None = None) -> Toolchain:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    if backend == "cpu":
        return Toolchain(torch=torch.__version__, python=py, backend=backend, target=cpu_isa(),
                         compiler=f"aotinductor-{torch.__version__}")
    if backend == "cuda":
        return Toolchain(torch=torch.__version__, python=py, backend=backend, target="cuda (compiled at load)",
                         compiler=f"inductor-{torch.__version__}")
    if backend == "neuron":
        return Toolchain(torch=torch.__version__, python=py, backend=backend, target=neuron_target or "",
                         compiler=NEURON_PENDING)
    return Toolchain(torch=torch.__version__, python=py, backend=backend, target="any", compiler="none")


def graph_hash(ir_sha256: str, tc: Toolchain, dtype: str) -> str:
    """The artifact identity of a graph: its canonical IR plus what the backend compiles it with."""
    key = f"{ir_sha256}|{tc.backend}|{tc.torch}|{tc.target}|{tc.compiler}|{dtype}"
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class CompileCache:
    root: Path
    hits: int = 0
    misses: int = 0

    def path(self, ghash: str, suffix: str) -> Path:
        return self.root / ghash[:2] / (ghash + suffix)

    def get(self, ghash: str, suffix: str) -> Path | None:
        """The cached file, if it is there whole: its content hash, written beside it by put(), must match (a
        truncated or damaged entry is a miss, and compiled again, not copied into an artifact as it is)."""
        p = self.path(ghash, suffix)
        check = p.with_name(p.name + ".sha256")
        if not p.is_file():
            return None
        try:
            ok = check.read_text().strip() == sha256_file(p)
        except OSError:
            ok = False
        if not ok:
            p.unlink(missing_ok=True)
            check.unlink(missing_ok=True)
            return None
        return p

    def put(self, ghash: str, suffix: str, src: Path) -> Path:
        dst = self.path(ghash, suffix)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        shutil.copyfile(src, tmp)
        digest = tmp.with_name(tmp.name + ".sha256")
        digest.write_text(sha256_file(tmp) + "\n")
        os.replace(digest, dst.with_name(dst.name + ".sha256"))
        os.replace(tmp, dst)
        return dst


def fetch(cache: CompileCache, backend: str, ghash: str, dest: Path) -> bool:
    """Copy a cached compiled file into place. Returns False on a miss."""
    hit = cache.get(ghash, SUFFIX[backend])
    if hit is None:
        return False
    shutil.copyfile(hit, dest)
    cache.hits += 1
    return True


def compile_file(backend: str, ep: torch.export.ExportedProgram, dest: Path, cache_root: Path) -> None:
    """Write the backend's compiled form of `ep` to `dest` (runs in a worker process)."""
    if backend != "cpu":
        raise BackendUnavailable(f"backend {backend!r} has no compiled-file step here")
    # Inductor keeps its precompiled headers in its cache dir: a persistent one saves seconds a graph.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root / "inductor"))
    torch._inductor.aoti_compile_and_package(ep, package_path=str(dest))
