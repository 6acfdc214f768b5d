"""The Neuron backend's CPU-host phase: prepared artifact, memory plan, compile commands, clear errors.
(Nothing here needs the Neuron SDK; the NEFF phase itself cannot run on these machines.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.common.errors import ArtifactError, BackendUnavailable
from deepinfer.common.manifest import NEURON_PENDING, Manifest
from deepinfer.compile.neuron import finish
from deepinfer.runtime.artifact import open_artifact
from deepinfer.runtime.engine import make_runner

V3 = Path(__file__).resolve().parents[2] / "configs" / "deepseek-v3-671b"
CLI = [sys.executable, "-c", "import sys; from deepinfer.cli import {fn}; {fn}()"]


def cli(fn: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI[0], CLI[1], CLI[2].format(fn=fn), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def prepared(checkpoints, compile_artifact):
    return compile_artifact(checkpoints["base"], backend="neuron", neuron_target="trn2", cp=2, ep=2)


def test_prepared_artifact_has_everything_but_the_neffs(prepared):
    m = Manifest.read(prepared)
    assert m.compile.backend == "neuron" and m.compile.neuron_target == "trn2"
    assert m.toolchain.compiler == NEURON_PENDING and m.toolchain.target == "trn2"
    assert len(m.weights) == 2 and all((prepared / w.path).is_file() for w in m.weights)
    assert all(g.file.endswith(".ep.pt2") and (prepared / g.file).is_file() for g in m.graphs)
    plan = json.loads((prepared / "neuron/plan.json").read_text())
    assert plan["target"] == "trn2" and plan["device_memory_gib_per_rank"] == 24
    assert {g["name"] for g in plan["graphs"]} == {g.name for g in m.graphs}
    layer = next(g for g in plan["graphs"] if g["name"] == "moe_layer.prefill.t32.c64")
    assert layer["compiler_args"][:2] == ["--target", "trn2"] and "--lnc" in layer["compiler_args"]
    assert layer["input_output_aliases"] == {"kv_cache": 3}          # after hidden, h_mid, overflow
    assert layer["state"]["attn.w_uk"] == "w_attn__w_uk" and layer["state"]["kv_cache"] == "kv_cache_state"
    assert [t["name"] for t in layer["step_inputs"]] == ["hidden", "positions", "slot_mapping", "block_tables",
                                                         "context_starts"]
    script = (prepared / "neuron/compile.sh").read_text()
    assert f"deepinfer-neuron-finish {prepared} --graph moe_layer.prefill.t32.c64" in script
    assert ".partial-" not in script


def test_runtime_and_finish_refuse_clearly_without_the_sdk(prepared):
    art = open_artifact(prepared)
    with pytest.raises(ArtifactError, match="NEFFs are not built yet; on a Neuron host run: deepinfer-neuron-finish"):
        make_runner(art, rank=0)
    with pytest.raises(BackendUnavailable, match="torch-neuronx and neuronx-cc come from AWS's Neuron package"):
        finish(prepared)
    r = cli("neuron_finish_main", str(prepared))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Neuron package repository" in r.stderr
    assert "Traceback" not in r.stderr


def test_finish_refuses_an_edited_artifact_and_unknown_graphs(prepared, tmp_path):
    """deepinfer-neuron-finish checks the artifact as compiled before anything (it rewrites the root hash, so it
    would otherwise approve an edited manifest), names a --graph the artifact lacks, and a broken plan.json."""
    import shutil
    art = tmp_path / "art"
    shutil.copytree(prepared, art)
    with pytest.raises(ArtifactError, match="no graph named nope"):
        finish(art, only=["nope"])
    (art / "neuron/plan.json").write_text("{")
    with pytest.raises(ArtifactError, match="plan.json: cannot be read"):
        finish(art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["compile"]["num_kv_blocks"] += 1
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="root hash does not match"):
        finish(art)


def test_neuron_target_is_required(checkpoints, tmp_path):
    r = cli("compile_main", "--model", str(checkpoints["base"]), "--out", str(tmp_path / "a"), "--backend", "neuron")
    assert r.returncode == 2 and "--neuron-target" in r.stderr


def test_deepseek_v3_671b_memory_plan_for_trn2(tmp_path):
    r = cli("compile_main", "--model", str(V3), "--shape-only", "--backend", "neuron", "--neuron-target", "trn2",
            "--cp", "64", "--ep", "64", "--dtype", "bfloat16", "--decode-buckets", "1,8", "--prefill-buckets", "512",
            "--context-limit", "8192", "--num-kv-blocks", "32768", "--out", str(tmp_path / "v3"))
    assert r.returncode == 0, r.stderr[-2000:]
    m = Manifest.read(tmp_path / "v3")
    assert m.layout.world == 64 and len(m.layout.ranks) == 64 and not m.weights
    assert m.layout.ranks[5].experts == (20, 24)
    mem = m.memory[0]
    # 4 of 256 experts per rank, attention/dense/embeddings replicated, bf16
    assert 46.0 < mem.weights_bytes / 2**30 < 47.0
    assert mem.kv_pool_bytes == 61 * (32768 // 64 + 1) * 16 * 576 * 2
    assert "DOES NOT FIT" in r.stderr
    plan = json.loads((tmp_path / "v3/neuron/plan.json").read_text())
    assert plan["memory"][0]["fits"] is False and len(plan["memory"]) == 64
    r = cli("compile_main", "--model", str(V3), "--shape-only", "--backend", "neuron", "--neuron-target", "trn2",
            "--cp", "64", "--ep", "64", "--dtype", "bfloat16", "--decode-buckets", "1", "--prefill-buckets", "",
            "--context-limit", "8192", "--num-kv-blocks", "32768", "--device-memory", "24",
            "--out", str(tmp_path / "v3b"))
    assert r.returncode == 2 and "needs 4" in r.stderr and "--device-memory is 24.00 GiB" in r.stderr
