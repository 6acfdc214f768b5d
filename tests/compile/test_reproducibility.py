"""Deterministic artifacts: same inputs, same hashes; lock diffs name the graph; damaged files are refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.common.errors import ArtifactError
from deepinfer.common.manifest import Manifest
from deepinfer.compile.lock import check_lock, update_lock
from deepinfer.runtime.artifact import open_artifact

COMPILE = [sys.executable, "-c", "from deepinfer.cli import compile_main; compile_main()"]
SMALL = ["--backend", "eager", "--decode-buckets", "1,4", "--prefill-buckets", "32", "--context-limit", "64"]


def _compile_cli(ck: Path, out: Path, *extra: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    cmd = [*COMPILE, "--model", str(ck), "--out", str(out), *SMALL, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, **kw)


def test_two_compiles_in_separate_processes_and_dirs_give_identical_hashes(checkpoints, tmp_path):
    ck = checkpoints["base"]
    a = _compile_cli(ck, tmp_path / "one" / "art", env={"PYTHONHASHSEED": "1"})
    b = _compile_cli(ck, tmp_path / "two" / "other", env={"PYTHONHASHSEED": "12345"})
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    ma, mb = Manifest.read(tmp_path / "one" / "art"), Manifest.read(tmp_path / "two" / "other")
    assert ma.root_hash == mb.root_hash
    assert [(g.name, g.ir_sha256, g.file_sha256) for g in ma.graphs] == [
        (g.name, g.ir_sha256, g.file_sha256) for g in mb.graphs]
    assert [w.sha256 for w in ma.weights] == [w.sha256 for w in mb.weights]
    # No machine path (e.g. of the installed sources) is part of a graph's canonical form.
    import zipfile
    import deepinfer
    src = str(Path(deepinfer.__file__).resolve().parent)
    for g in ma.graphs:
        with zipfile.ZipFile(tmp_path / "one" / "art" / g.file) as z:
            assert all(src.encode() not in z.read(n) for n in z.namelist()), g.name


def test_lock_diff_names_exactly_the_changed_graphs(checkpoints, compile_artifact, tmp_path):
    ck = checkpoints["base"]
    base = Manifest.read(compile_artifact(ck, moe_path="static"))
    lock = tmp_path / "hashes.lock.json"
    update_lock(base, lock)
    assert check_lock(base, lock) == []
    # On the static MoE path, a different capacity changes only the capacity-grouped prefill MoE graph (its key changes too, so
    # compare by rewriting the key: the lock entry of the base is checked against the new graphs).
    changed = Manifest.read(compile_artifact(ck, moe_capacity=3))
    data = json.loads(lock.read_text())
    (key, entry), = data["entries"].items()
    from deepinfer.compile.lock import lock_key
    data["entries"] = {lock_key(changed): entry}
    lock.write_text(json.dumps(data))
    diff = check_lock(changed, lock)
    assert diff and all(line.startswith("changed   graph moe_layer.prefill.t32.") for line in diff), diff
    assert len(diff) == len(base.compile.context_buckets)


def test_lock_reports_appeared_and_vanished_graphs(checkpoints, compile_artifact, tmp_path):
    m = Manifest.read(compile_artifact(checkpoints["base"]))
    lock = tmp_path / "l.json"
    update_lock(m, lock)
    data = json.loads(lock.read_text())
    entry = next(iter(data["entries"].values()))
    entry["graphs"]["ghost.t9"] = "0" * 64
    del entry["graphs"]["head.decode.t4"]
    lock.write_text(json.dumps(data))
    diff = check_lock(m, lock)
    assert "vanished  graph ghost.t9" in diff and any(d.startswith("appeared  graph head.decode.t4") for d in diff)


@pytest.mark.parametrize("target", ["weights/rank0.safetensors", "graphs/moe_layer.decode.t4.c128.ep.pt2",
                                    "tokenizer/tokenizer.json"])
def test_flipped_byte_is_refused_naming_the_file(checkpoints, compile_artifact, tmp_path, target):
    import shutil
    src = compile_artifact(checkpoints["base"])
    art = tmp_path / "art"
    shutil.copytree(src, art)
    p = art / target
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=target.split("/")[-1].replace(".", r"\.") + r".*sha256"):
        open_artifact(art)


def test_truncated_or_missing_file_and_edited_manifest_are_refused(checkpoints, compile_artifact, tmp_path):
    import shutil
    art = tmp_path / "art"
    shutil.copytree(compile_artifact(checkpoints["base"]), art)
    w = art / "weights/rank0.safetensors"
    w.write_bytes(w.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match="rank0.safetensors: .* bytes, the manifest says"):
        open_artifact(art)
    w.unlink()
    with pytest.raises(ArtifactError, match="rank0.safetensors: missing"):
        open_artifact(art)
    mf = art / "manifest.json"
    mf.write_text(mf.read_text().replace('"block_size": 16', '"block_size": 32'))
    with pytest.raises(ArtifactError, match="root hash does not match"):
        open_artifact(art)


def test_manifest_edits_the_file_hashes_cannot_see_are_refused(checkpoints, compile_artifact, tmp_path):
    """Two graphs' files swapped in the manifest (each file still matching the hash beside it), the toolchain
    edited, or a manifest that is not text: all refused before anything loads."""
    import shutil
    art = tmp_path / "art"
    shutil.copytree(compile_artifact(checkpoints["base"]), art)
    mf = art / "manifest.json"
    good = mf.read_text()
    data = json.loads(good)
    g = {x["name"]: x for x in data["graphs"]}
    a, b = g["moe_layer.decode.t1.c64"], g["dense_layer.decode.t1.c64"]
    a["file"], a["file_sha256"] = b["file"], b["file_sha256"]
    mf.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="root hash does not match"):
        open_artifact(art)
    data = json.loads(good)
    data["toolchain"]["compiler"] += " (edited)"
    mf.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="root hash does not match"):
        open_artifact(art)
    mf.write_bytes(b'{"schema_version": "\xd0\x00"}')
    with pytest.raises(ArtifactError, match="manifest.json: not UTF-8 text"):
        open_artifact(art)


def _rehashed(art: Path, edit) -> None:
    """The artifact's manifest after `edit(data)`, with every file hash and the root hash rewritten to match: what
    only the runtime's own checks can refuse."""
    from deepinfer.common import serde
    from deepinfer.common.manifest import sha256_file
    mf = art / "manifest.json"
    data = json.loads(mf.read_text())
    edit(data)
    for w in data["weights"]:
        w["sha256"], w["bytes"] = sha256_file(art / w["path"]), (art / w["path"]).stat().st_size
    for g in data["graphs"]:
        g["file_sha256"] = sha256_file(art / g["file"])
    try:
        data["root_hash"] = serde.loads(Manifest, json.dumps(data), "edited").compute_root_hash()
    except ArtifactError:          # an edit the manifest's types refuse: no hash to rewrite
        pass
    mf.write_text(json.dumps(data))


def test_a_manifest_rewritten_with_its_hashes_is_still_checked(checkpoints, compile_artifact, tmp_path):
    """Edits that keep the types and rewrite the hashes: sizes the runtime divides by or indexes with, an unknown
    dtype, a context limit the graphs were not built for, a file outside the artifact."""
    import shutil
    src = compile_artifact(checkpoints["base"])
    cases = [(lambda d: d["compile"].update(block_size=0), "compile.block_size=0 must be at least 1"),
             (lambda d: d["compile"].update(num_kv_blocks=0), "compile.num_kv_blocks=0 must be at least 1"),
             (lambda d: d["compile"].update(decode_buckets=[]), "compile.decode_buckets=[] must be distinct"),
             (lambda d: d["compile"].update(dtype="float16"), "compile.dtype='float16' is not float32 or bfloat16"),
             (lambda d: d["compile"].update(context_limit=4096), "context_limit=4096 is not the last context bucket"),
             (lambda d: d["tokenizer"][0].update(path="../../etc/passwd"), "is not inside the artifact"),
             (lambda d: d["layout"]["ranks"][0].update(experts=[0]), "experts: expected a list of 2, got 1")]
    for i, (edit, message) in enumerate(cases):
        art = tmp_path / f"a{i}"
        shutil.copytree(src, art)
        _rehashed(art, edit)
        with pytest.raises(ArtifactError, match=re.escape(message)):
            open_artifact(art)


def test_weights_and_graphs_rewritten_with_their_hashes_are_refused_at_load(checkpoints, compile_artifact,
                                                                             tmp_path):
    """A weight shard whose tensors differ from the manifest's list (its hash rewritten with it): a tensor of
    another shape (it ran, with other output), a missing one (a KeyError), a file that is not safetensors, and a
    graph file that is not a graph: each an ArtifactError naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from deepinfer.runtime.engine import Engine
    art = tmp_path / "art"
    shutil.copytree(compile_artifact(checkpoints["base"]), art)
    shard = art / "weights/rank0.safetensors"
    good = shard.read_bytes()
    tensors = load_file(shard)
    name = next(k for k in tensors if k.endswith("attn.o_proj"))
    for change, message in ((lambda t: t.update({name: t[name][:, :-1].contiguous()}), f"weight '{name}' is"),
                            (lambda t: t.pop(name), f"has no tensor '{name}'")):
        edited = dict(tensors)
        change(edited)
        save_file(edited, shard, metadata={"format": "pt"})
        _rehashed(art, lambda d: None)
        with pytest.raises(ArtifactError, match=re.escape(message)):
            Engine.from_artifact(art)
    shard.write_bytes(b"not a safetensors file" * 10)
    _rehashed(art, lambda d: None)
    with pytest.raises(ArtifactError, match="rank0.safetensors: not a readable safetensors file"):
        Engine.from_artifact(art)
    shard.write_bytes(good)
    graph = art / json.loads((art / "manifest.json").read_text())["graphs"][0]["file"]
    graph.write_bytes(b"junk" * 100)
    _rehashed(art, lambda d: None)
    with pytest.raises(ArtifactError, match=r"cannot be loaded .*the artifact is damaged"):
        Engine.from_artifact(art)


@pytest.mark.parametrize("content,message", [
    ("[]", "expected a JSON object"), ('{"schema": 1, "entries": []}', "'entries' must map"),
    ('{"schema": 1, "entries": {"k": []}}', "'entries' must map"), ("{nope", "not a valid lock file"),
    (None, "not a file")])
def test_bad_lock_file_is_named(checkpoints, compile_artifact, tmp_path, content, message):
    from deepinfer.common.errors import OptionError
    m = Manifest.read(compile_artifact(checkpoints["base"]))
    lock = tmp_path / "lock.json"
    if content is None:
        lock.mkdir()
    else:
        lock.write_text(content)
    for fn in (check_lock, update_lock):
        with pytest.raises(OptionError, match=message):
            fn(m, lock)


def test_toolchain_mismatch_is_refused(checkpoints, compile_artifact, tmp_path):
    import dataclasses
    import shutil
    art = tmp_path / "art"
    shutil.copytree(compile_artifact(checkpoints["base"]), art)
    m = Manifest.read(art)
    m = dataclasses.replace(m, toolchain=dataclasses.replace(m.toolchain, torch="2.11.0"))
    m = dataclasses.replace(m, root_hash=m.compute_root_hash())
    (art / "manifest.json").write_text(m.dumps())
    with pytest.raises(ArtifactError, match="compiled with torch 2.11.0"):
        open_artifact(art)


def test_interrupted_compile_leaves_no_loadable_artifact(checkpoints, tmp_path):
    out = tmp_path / "art"
    proc = subprocess.Popen([*COMPILE, "--model", str(checkpoints["base"]),
                             "--out", str(out), *SMALL], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:          # kill it in the middle of the graph exports
        if line.startswith("[graph 3/"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode != 0
    with pytest.raises(ArtifactError, match="no such artifact directory|no manifest"):
        open_artifact(out)
