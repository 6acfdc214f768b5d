"""The Neuron backend, in two phases.

Phase 1 (any host, no Neuron SDK): `deepinfer-compile --backend neuron --neuron-target trn2` writes the
whole artifact except the NEFFs: layout, per-rank weight shards, the memory plan against the target's
device memory, every graph as a portable exported program (graphs/*.ep.pt2), and neuron/plan.json +
neuron/compile.sh with the exact commands that finish it.

Phase 2 (a Neuron host): `deepinfer-neuron-finish ARTIFACT` traces each exported graph with
`torch_neuronx.trace(..., inline_weights_to_neff=False, input_output_aliases=...)` (neuronx-cc runs on the
HLO torch-xla records), saves graphs/*.neff.pt, and rewrites the manifest with the NEFF hashes and the
neuronx-cc version. Weights stay out of the NEFF: each graph takes its layer's weights and KV pool as
state that the runtime fills per layer with `torch_neuronx.replace_weights`; the KV pool is aliased from
input to output so that the in-place update happens on the device.

Nothing here has run on a Neuron device (none was available where it was written); phase 2 and the runtime
path are written against the documented torch-neuronx API and fail with one clear message without it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import time
from pathlib import Path

from ..common.errors import ArtifactError, BackendUnavailable
from ..common.manifest import MANIFEST_FILE, NEURON_PENDING, GraphEntry, Manifest, neuron_state_name, sha256_file

# Device memory one rank (one NeuronCore, or one logical core on trn2 with LNC=2) can use.
TARGET_MEMORY_GIB = {"trn1": 16, "trn2": 24, "inf2": 16}
PENDING = NEURON_PENDING
SDK_HINT = ("the AWS Neuron SDK is not installed here: torch-neuronx and neuronx-cc come from AWS's Neuron "
            "package repository (pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
            "torch-neuronx neuronx-cc), on a trn1/trn2/inf2 host; the PyPI packages of those names are placeholders")


def compiler_args(target: str) -> list[str]:
    """neuronx-cc flags for one region graph (transformer model type, bf16 matmuls, trn2 logical cores)."""
    args = ["--target", target, "--model-type", "transformer", "--auto-cast", "none", "-O1"]
    if target == "trn2":
        args += ["--lnc", "2"]
    return args


def require_sdk():
    """Import torch_neuronx or raise one clear error naming what is missing and where it comes from."""
    try:
        import torch_neuronx  # type: ignore[import-not-found]
    except Exception as e:  # the PyPI placeholder raises ImportError with its own text
        raise BackendUnavailable(f"{SDK_HINT} (import torch_neuronx failed: {type(e).__name__})") from None
    return torch_neuronx


def write_plan(root: Path, m: Manifest, final_root: Path | None = None) -> None:
    """neuron/plan.json (per graph: inputs, state, aliasing, compiler flags) and neuron/compile.sh, written
    into `root` and naming the artifact by `final_root` (where it will be installed)."""
    name = shlex.quote(str(final_root or root))
    cc = m.compile
    target = cc.neuron_target or "trn2"
    d = root / "neuron"
    d.mkdir(exist_ok=True)
    graphs = []
    for g in m.graphs:
        kv = [i for i, t in enumerate(g.inputs) if t.name == "kv_cache"]
        graphs.append({
            "name": g.name, "exported_program": g.file, "neff": f"graphs/{g.name}.neff.pt",
            "step_inputs": [dataclasses.asdict(t) for t in g.inputs if t.name != "kv_cache"],
            "state": {w.key: neuron_state_name(w.key) for w in g.weights} | ({"kv_cache": "kv_cache_state"} if kv else {}),
            "input_output_aliases": {"kv_cache": len(g.outputs)} if kv else {},
            "compiler_args": compiler_args(target),
            "command": f"deepinfer-neuron-finish {name} --graph {g.name}",
        })
    plan = {"target": target, "device_memory_gib_per_rank": TARGET_MEMORY_GIB[target],
            "memory": [dataclasses.asdict(r) | {"fits": r.total <= TARGET_MEMORY_GIB[target] << 30}
                       for r in m.memory],
            "graphs": graphs}
    (d / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    lines = ["#!/usr/bin/env bash",
             "# Finish this artifact on a Neuron host (torch-neuronx + neuronx-cc from AWS's Neuron repository).",
             "# All graphs at once:", f"#   deepinfer-neuron-finish {name}",
             "# or one graph per command (parallel across hosts or cores):", "set -euo pipefail"]
    lines += [g["command"] for g in graphs]
    (d / "compile.sh").write_text("\n".join(lines) + "\n")
    os.chmod(d / "compile.sh", 0o755)


def finish(root: Path, only: list[str] | None = None, log=print) -> Manifest:
    """Phase 2: trace every (or the named) graph to a NEFF and rewrite the manifest."""
    import torch
    from ..runtime.artifact import open_artifact
    root = Path(root)
    # the artifact as compiled (root hash, every file's hash), or this would approve an edited one with a new hash
    m = open_artifact(root, verify=True, check_toolchain=False).manifest
    if m.compile.backend != "neuron":
        raise ArtifactError(f"{root}: backend is {m.compile.backend!r}, not neuron")
    unknown = sorted(set(only or ()) - {g.name for g in m.graphs})
    if unknown:
        raise ArtifactError(f"{root}: no graph named {', '.join(unknown)} (deepinfer-inspect {root} lists them)")
    try:
        plan = {g["name"]: g for g in json.loads((root / "neuron/plan.json").read_text())["graphs"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{root / 'neuron/plan.json'}: cannot be read ({type(e).__name__}: {e}); compile the "
                            f"artifact again") from None
    missing = [g.name for g in m.graphs if g.name not in plan and not g.file.endswith(".neff.pt")]
    if missing:
        raise ArtifactError(f"{root / 'neuron/plan.json'}: no plan for {', '.join(missing[:3])}; compile the "
                            f"artifact again")
    torch_neuronx = require_sdk()
    import neuronxcc  # type: ignore[import-not-found]
    version = f"neuronx-cc-{getattr(neuronxcc, '__version__', 'unknown')}"
    new: list[GraphEntry] = []
    for g in m.graphs:
        if only and g.name not in only or g.file.endswith(".neff.pt"):
            new.append(g)
            continue
        t = time.perf_counter()
        p = plan[g.name]
        module = NeuronRegion(torch.export.load(str(root / p["exported_program"])).module(), g)
        example = module.example_inputs()
        aliases = {module.kv_cache: len(g.outputs)} if module.kv_cache is not None else {}
        traced = torch_neuronx.trace(module, example, compiler_args=p["compiler_args"],
                                     compiler_workdir=str(root / "neuron" / "work" / g.name),
                                     inline_weights_to_neff=False, input_output_aliases=aliases)
        out = root / p["neff"]
        torch.jit.save(traced, str(out))
        new.append(dataclasses.replace(g, file=p["neff"], file_sha256=sha256_file(out)))
        log(f"[neff] {g.name} {time.perf_counter() - t:.0f}s")
    done = all(g.file.endswith(".neff.pt") for g in new)
    tc = dataclasses.replace(m.toolchain, compiler=version if done else PENDING)
    m = dataclasses.replace(m, graphs=tuple(new), toolchain=tc)
    m = dataclasses.replace(m, root_hash=m.compute_root_hash())
    tmp = root / (MANIFEST_FILE + ".tmp")
    tmp.write_text(m.dumps())
    os.replace(tmp, root / MANIFEST_FILE)
    return m


def NeuronRegion(exported_module, g: GraphEntry):
    """Wrap an exported region so its weights and KV pool are module state (not inlined into the NEFF) and
    the updated KV pool is returned as an extra output (aliased to its input on the device)."""
    import torch

    class Region(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = exported_module
            self.keys = [w.key for w in g.weights]
            self.step_specs = [t for t in g.inputs if t.name != "kv_cache"]
            self.has_kv = any(t.name == "kv_cache" for t in g.inputs)
            dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
            for w in g.weights:
                self.register_buffer(neuron_state_name(w.key), torch.zeros(w.shape, dtype=dt[w.dtype]))
            for t in g.inputs:
                if t.name == "kv_cache":
                    self.register_buffer("kv_cache_state", torch.zeros(t.shape, dtype=dt[t.dtype]))
            self._dt = dt

        @property
        def kv_cache(self):
            return self.kv_cache_state if self.has_kv else None

        def example_inputs(self):
            return tuple(torch.zeros(t.shape, dtype=self._dt[t.dtype]) for t in self.step_specs)

        def forward(self, *step):
            weights = {k: getattr(self, neuron_state_name(k)) for k in self.keys}
            args = list(step)
            if self.has_kv:
                args.insert(4, self.kv_cache_state)     # hidden, positions, slot_mapping, block_tables, kv_cache
            out = self.inner(*args, weights)
            out = out if isinstance(out, (tuple, list)) else (out,)
            return (*out, self.kv_cache_state) if self.has_kv else tuple(out)

    return Region()
