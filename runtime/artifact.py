"""Open an artifact: verify every file and the toolchain against the manifest, then load graphs and weights."""

from __future__ import annotations

import mmap
import os
import platform
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..common.errors import ArtifactError
from ..common.manifest import GraphEntry, Manifest, sha256_file
from ..common.toolchain import cpu_isa
from . import ops  # noqa: F401  (registers the deepinfer::* ops the graphs call)


@dataclass(frozen=True)
class Artifact:
    root: Path
    manifest: Manifest

    def file(self, rel: str) -> Path:
        return self.root / rel


def open_artifact(root: str | Path, verify: bool = True, check_toolchain: bool = True) -> Artifact:
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such artifact directory (run deepinfer-compile first)")
    manifest = Manifest.read(root)
    art = Artifact(root, manifest)
    if manifest.compute_root_hash() != manifest.root_hash:
        raise ArtifactError(f"{root / 'manifest.json'}: root hash does not match its contents "
                            f"(the manifest was edited after compile)")
    if check_toolchain:
        verify_toolchain(manifest)
    if verify:
        verify_files(art)
    return art


_DEVICES = {"cpu": ("cpu",), "neuron": ("cpu",), "eager": ("cpu", "cuda"), "cuda": ("cpu", "cuda")}


def check_device(manifest: Manifest, device: str, ranks_here: int = 1) -> None:
    """`--device` against this host and the artifact's backend, before anything loads or spawns. `ranks_here`:
    the ranks this host runs (all of the layout's when the leader spawns its followers), one GPU each."""
    from ..common.errors import OptionError
    backend = manifest.compile.backend
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise OptionError(f"--device {device!r} is not a device (cpu, cuda or cuda:N)") from None
    allowed = _DEVICES.get(backend, ("cpu", "cuda"))
    if dev.type == "cpu" and dev.index not in (None, 0):     # torch parses it; nothing loads onto it
        raise OptionError(f"--device {device}: the CPU is one device, 'cpu' (its threads: --threads)")
    if dev.type not in allowed:
        hint = {"cpu": "compile with --backend cuda for a GPU", "neuron": "its graphs run on NeuronCores"}.get(
            backend, "")
        raise OptionError(f"--device {device}: this artifact's backend is {backend}, which runs on "
                          f"{' or '.join(allowed)}" + (f" ({hint})" if hint else ""))
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "" if torch.version.cuda else "; this torch is a CPU-only build"
            raise OptionError(f"--device {device}: no CUDA device is available here{build}")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise OptionError(f"--device {device}: this host has {count} CUDA device(s)")
        if ranks_here > 1 and dev.index is not None:
            raise OptionError(f"--device {device} names one GPU, but this artifact's {ranks_here} ranks take one "
                              f"each: pass --device cuda")
        if ranks_here > count:
            raise OptionError(f"--device {device}: {ranks_here} of this artifact's ranks (cp x ep) run on this host, "
                              f"which has {count} CUDA device(s); each rank needs its own (NCCL refuses two ranks on "
                              f"one)")


def verify_files(art: Artifact) -> None:
    """Every file the manifest names: present, full size, same sha256. Names the first bad file."""
    m = art.manifest
    items: list[tuple[str, str, int | None]] = [(g.file, g.file_sha256, None) for g in m.graphs]
    items += [(w.path, w.sha256, w.bytes) for w in m.weights]
    items += [(t.path, t.sha256, t.bytes) for t in m.tokenizer]
    for rel, sha, size in items:
        p = art.file(rel)
        if not p.is_file():
            raise ArtifactError(f"{p}: missing (listed in the manifest)")
        if size is not None and p.stat().st_size != size:
            raise ArtifactError(f"{p}: {p.stat().st_size} bytes, the manifest says {size} (truncated or replaced)")
        got = sha256_file(p)
        if got != sha:
            raise ArtifactError(f"{p}: sha256 {got[:16]}… does not match the manifest's {sha[:16]}… (file altered)")


def verify_toolchain(m: Manifest) -> None:
    tc = m.toolchain
    # exported programs (eager, cuda) and AOTInductor packages (cpu) load with the torch that wrote them
    if tc.backend in ("cpu", "eager", "cuda") and tc.torch != torch.__version__:
        raise ArtifactError(f"artifact was compiled with torch {tc.torch}, this is torch {torch.__version__}; "
                            f"recompile it here")
    if tc.backend == "cpu":
        here = cpu_isa()
        if tc.target != here:
            raise ArtifactError(f"artifact was compiled for CPU {tc.target}, this machine is {here}; recompile it here")


GraphFn = Callable[..., object]


def load_graph(art: Artifact, g: GraphEntry, device: torch.device, rank: int = 0) -> GraphFn:
    backend = art.manifest.compile.backend
    path = str(art.file(g.file))
    if device.type == "cpu":
        from . import cpu_kernels
        cpu_kernels.available()          # build or load the CPU kernels now, not in the first request
    if backend in ("cpu", "eager"):
        try:
            if backend == "cpu":
                return _FlatAOTI(_load_aoti(path), [w.key for w in g.weights])
            return torch.export.load(path).module()
        except ArtifactError as e:
            raise ArtifactError(f"graph {g.name}: {e}") from None
        except (RuntimeError, ValueError, OSError, zipfile.BadZipFile) as e:   # not a package at all
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ArtifactError(f"graph {g.name} ({g.file}) cannot be loaded ({why}); the artifact is damaged") \
                from None
    if backend == "cuda":
        # Compiled at load: AOTInductor packages were seen to segfault on load with torch 2.11 + CUDA 13,
        # torch.compile of the exported program works there (in-place KV writes included). On a CPU device
        # the same path compiles for the CPU (used to test it without a GPU).
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ArtifactError("this artifact's backend is cuda, but no CUDA device is available here")
        return compile_exported(torch.export.load(path), device)
    if backend == "neuron":
        from .neuron import NeuronGraph, check_finished
        check_finished(art)
        return NeuronGraph(art, g, core=rank)     # each rank claims the NeuronCore of its rank
    raise ArtifactError(f"manifest backend {backend!r} is unknown")


def compile_exported(ep: torch.export.ExportedProgram, device: torch.device) -> GraphFn:
    """An exported graph compiled at load for `device` (the cuda backend)."""
    ep = exported_on(ep, device)
    if device.type == "cuda":
        from .cuda_kernels import skinny_mode
        if skinny_mode() != "0":          # checks the variable once, at load
            skinny_linears(ep)
    return torch.compile(ep.module(), fullgraph=True, dynamic=False)


def skinny_linears(ep: torch.export.ExportedProgram) -> int:
    """Rewrite (in place) the bf16/fp16 linears of at most SKINNY_MAX_ROWS rows (decode steps' projections and head)
    to deepinfer::rows_linear, whose CUDA path runs each shape on cuBLAS or the Triton skinny GEMM, whichever
    measured faster on the device (runtime/cuda_kernels.py). The IR and its hashes stay the compile's: this is
    a load-time choice of kernel. Returns how many were rewritten."""
    from .cuda_kernels import SKINNY_MAX_ROWS
    n = 0
    for node in ep.graph_module.graph.nodes:
        if (node.op != "call_function" or node.target is not torch.ops.aten.linear.default or len(node.args) != 2
                or node.kwargs):
            continue
        x, w = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args)
        if (x is not None and w is not None and x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype
                and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= SKINNY_MAX_ROWS):
            node.target = torch.ops.deepinfer.rows_linear.default
            n += 1
    if n:
        ep.graph_module.recompile()
    return n


def exported_on(ep: torch.export.ExportedProgram, device: torch.device) -> torch.export.ExportedProgram:
    """The program for inputs on `device`. Graphs are traced on the CPU, and non-strict export writes device=cpu
    into every node that makes a tensor (arange, zeros) or checks one (the _assert_tensor_metadata after each
    .to(dtype)): compiled as they are, the first call with CUDA inputs stops at "Tensor device mismatch". So the
    program moves to the device first, with its index spelled out (a node's `cuda` would not match the inputs'
    `cuda:0` either)."""
    if device.type == "cpu":
        return ep
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from torch.export.passes import move_to_device_pass
    return move_to_device_pass(ep, device)


def _load_aoti(path: str):
    """aoti_load_package extracts the package under $TMPDIR and removes the copy only in the loader's
    destructor, so a killed process leaves ~2 MB a graph in /tmp. Extract into a private directory instead and
    remove it once loaded: the shared object stays mapped, and these graphs carry no constants to read later."""
    import shutil
    import tempfile
    private = tempfile.mkdtemp(prefix="deepinfer-aoti-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = private
    try:
        return torch._inductor.aoti_load_package(path)
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(private, ignore_errors=True)


class _FlatAOTI:
    """Calls an AOTInductor package with its inputs already flat: step tensors, then the weights in the
    manifest's order (the order they were traced in). AOTICompiledModel.__call__ re-parses its tree specs and
    flattens the weight dict on every call, which costs ~0.1 ms a call."""

    def __init__(self, model, weight_keys: list[str]):
        import torch.utils._pytree as pytree
        self.loader = model.loader
        in_spec = pytree.treespec_loads(self.loader.get_call_spec()[0])
        def kids(spec):       # torch >= 2.12 has children(); 2.11 only children_specs
            return spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
        traced_keys = kids(kids(in_spec)[0])[-1].context
        traced = list(traced_keys)
        if traced != weight_keys:
            at = next((i for i, (a, b) in enumerate(zip(traced, weight_keys)) if a != b),
                      min(len(traced), len(weight_keys)))
            theirs = traced[at] if at < len(traced) else "nothing"
            ours = weight_keys[at] if at < len(weight_keys) else "nothing"
            raise ArtifactError(f"the compiled graph takes {len(traced)} weights and the manifest lists "
                                f"{len(weight_keys)}: weight {at} is {theirs!r} in the graph, {ours!r} in the manifest "
                                f"(a graph file of another graph?)")

    def __call__(self, *args):
        *step, weights = args
        return self.loader.boxed_run([*step, *weights.values()])


def load_weights(art: Artifact, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    shard = next((w for w in art.manifest.weights if w.rank == rank), None)
    if shard is None:
        raise ArtifactError(f"{art.root}: the manifest has no weight shard for rank {rank} "
                            f"(a shape-only artifact cannot run)")
    path = art.file(shard.path)
    try:
        weights = load_file(str(path), device=str(device))
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path}: cannot be read ({e})") from None
    except SafetensorError as e:
        raise ArtifactError(f"{path}: not a readable safetensors file ({e}); the artifact is damaged") from None
    if device.type == "cpu" and os.environ.get(HUGE_PAGES_ENV, "1") != "0":
        weights = _into_huge_page_arena(weights)
    return weights


HUGE_PAGES_ENV = "DEEPINFER_WEIGHTS_ARENA"    # 0: serve CPU weights from the file mapping (evictable page cache)


def _into_huge_page_arena(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU: copy the weights out of the file mapping safetensors serves them from into one private anonymous
    arena advised for transparent huge pages (Linux; elsewhere, or with THP off, a plain anonymous copy).
    Decode streams every weight once a step, and the file mapping's 4 KB page-cache pages are the slowest memory
    to stream: the `mid` model's expert GEMM at 4 rows a group read its weights at 16-21 GB/s from the file
    mapping, 23-25 GB/s from an ordinary copy and 25-26 GB/s from the huge-page arena (2 threads); its MoE
    layer graph at 16 tokens 8.2-9.4 -> 7.9-8.5 ms. Costs one copy at load (~0.2 s a GB), and the weights are
    then anonymous memory the kernel cannot evict (DEEPINFER_WEIGHTS_ARENA=0 keeps the file mapping)."""
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in weights.values()]   # 64-byte aligned slots
    align = 2 << 20
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    arena = mmap.mmap(-1, sum(sizes) + align, **({"flags": flags} if flags else {}))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            arena.madvise(mmap.MADV_HUGEPAGE)
        except OSError:              # THP disabled: still an anonymous copy
            pass
    buf = torch.frombuffer(arena, dtype=torch.uint8)   # the tensors keep the mapping alive
    off = -buf.data_ptr() % align
    out = {}
    for (name, t), size in zip(weights.items(), sizes):
        dst = buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        dst.copy_(t)
        out[name] = dst
        off += size
    return out


def machine() -> str:
    return f"{platform.machine()} python {sys.version_info.major}.{sys.version_info.minor}"
