"""Hand-written CPU kernels (runtime/csrc/), built once per machine with torch.utils.cpp_extension.

Only what torch and Inductor do not do well enough: `grouped_rows_mm`, a GEMM for groups of a few rows, where
MKL's sgemm runs far under the memory peak (the MoE experts up to 64 rows an expert, and as one group CPU graphs' few-row linears
on big weights), `paged_mla_decode`, decode attention read straight from the paged latent pool, and
`prefill_attention`, a prefill chunk's causal attention over only the keys each query sees. The library also
registers C++ CPU implementations of the graphs' ops (`deepinfer::grouped_mm`, `rows_linear`, `paged_mla_decode`,
`prefill_attention`, defined in runtime/ops.py), so a compiled graph's call reaches them without entering Python.
They are an optimisation, never a dependency: when they cannot be used here (not x86-64 with AVX2, no C++
compiler, a failed build, DEEPINFER_CPU_KERNELS=0), `available()` says False once, with the reason, and the ops
keep their Python bodies (torch's own paths).

The build (~30 s, two cores) happens at the first `available()` call, which the runtime makes while it loads a
CPU artifact, so no request waits for it; later processes find it in torch's extension cache
($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), keyed by a hash of the sources, the headers, the
checkout's path and torch's version. Concurrent processes build one at a time, and a build killed half-way does
not block later ones.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger("deepinfer")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / name for name in ("grouped_rows_mm.cpp", "paged_mla_decode.cpp", "prefill_attention.cpp")]
HEADERS = sorted(CSRC.glob("*.h"))
ENV = "DEEPINFER_CPU_KERNELS"

_state: dict[str, object] = {}


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used here (None: they can). Builds them on the first call."""
    if "reason" not in _state:
        _state["reason"] = _load()
        if _state["reason"] is not None:
            log.info("CPU kernels not used: %s", _state["reason"])
    return _state["reason"]          # type: ignore[return-value]


def available() -> bool:
    return unavailable_reason() is None


TUNING_ENV = "DEEPINFER_CPU_TUNING"


def _load() -> str | None:
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    tuning = os.environ.get(TUNING_ENV)
    if tuning is not None and tuning not in ("zen4", "zen5", "auto"):
        log.warning("%s=%r is not zen4, zen5 or auto: ignored (the kernels tune for this CPU)", TUNING_ENV, tuning)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"no kernels for {platform.machine()} (x86-64 AVX2 only)"
    try:
        caps = torch.backends.cpu.get_cpu_capability()
    except Exception:
        caps = "unknown"
    if caps not in ("AVX2", "AVX512"):
        return f"this CPU's vector ISA is {caps}; the kernels need AVX2 and FMA"
    if hasattr(torch.ops.deepinfer_cpu, "prefill_attention"):
        return None                  # already loaded in this process
    if shutil.which("ninja") is None:  # torch's builder runs `ninja` from PATH; the pip wheel's may not be on it
        try:
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            return "ninja is not installed (pip install ninja)"
    from . import ops        # noqa: F401  the deepinfer:: ops the library gives CPU implementations to
    try:
        import fcntl                      # POSIX: where the kernels build at all
        from torch.utils import cpp_extension
        name = library_name()
        build_dir = build_directory(name)
        build_dir.mkdir(parents=True, exist_ok=True)
        log.info("loading the CPU kernels (built once per machine, ~30 s)")
        with open(build_dir / "deepinfer.flock", "w") as held:
            # One deepinfer process builds at a time, the others wait here. torch's own lock is a `lock` file that
            # a process killed mid-build leaves behind, and every later build waits on it forever; under this
            # lock (the kernel drops it with its holder) no deepinfer build is running, so such a file is stale.
            fcntl.flock(held, fcntl.LOCK_EX)
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a CPU-kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            cpp_extension.load(name=name, sources=[str(src) for src in SOURCES], is_python_module=False,
                               extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
                               build_directory=str(build_dir), verbose=False)
    except Exception as e:           # no compiler, no ninja, a failed build: torch's path stays
        last = (str(e).strip().splitlines() or [""])[-1][:300]
        return f"building the kernels in {SOURCES[0].parent} failed: {type(e).__name__}: {last}"
    return None


def library_name() -> str:
    """The build's name: a hash of the sources, the headers, the checkout's path (one build a checkout: ninja
    would rebuild one whose files name another checkout's paths) and torch's version (a library built against
    another torch may not load, or may misbehave, in this one: torch upgraded in place keeps its header paths,
    so torch's own builder would not see the change)."""
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        data = src.read_bytes()
        h.update(f"{src.name}:{len(data)}:".encode() + data)
    h.update(str(CSRC).encode())
    h.update(f"torch {torch.__version__}".encode())
    return f"deepinfer_cpu_{h.hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    """Where the kernels are built and cached: torch's extension cache ($TORCH_EXTENSIONS_DIR, default
    ~/.cache/torch_extensions), in the folder torch would pick for them."""
    from torch.utils import cpp_extension
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / name
