"""The artifact hash lock: expected graph-IR and weight hashes per reference configuration.

Graph identity here is the canonical exported program's hash (machine independent); the compiled
binary embeds paths and is checked at load time instead. A lock entry is keyed by everything that
shapes the graphs (model config, layout, buckets, dtype, and the backend's IR family: `eager` traces
exactly the graphs `cpu` compiles, so the references lock the CPU IR in seconds).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..common import serde
from ..common.errors import OptionError
from ..common.manifest import Manifest
from .graphs import ir_family

LOCK_SCHEMA = 1


def lock_key(m: Manifest) -> str:
    cc = m.compile
    model = hashlib.sha256(serde.dumps(m.model).encode()).hexdigest()[:12]
    dtype = cc.dtype + (f"/weights={cc.weight_dtype}" if cc.weight_dtype else "")
    dtype += f"/matmul={cc.matmul_dtype}" if cc.matmul_dtype else ""
    dtype += "/region-marks" if cc.region_marks else ""
    moe = cc.moe_path + ("+shared" if cc.shared_experts_grouped else "")
    return (f"{m.name}@{model} cp={cc.cp} ep={cc.ep} {dtype} decode={list(cc.decode_buckets)} "
            f"prefill={list(cc.prefill_buckets)} ctx={list(cc.context_buckets)} bs={cc.block_size} "
            f"kv={cc.num_kv_blocks} cap={list(cc.moe_capacity)} moe={moe}/{cc.moe_decode_path} "
            f"ir={ir_family(cc.backend)}")


def lock_entry(m: Manifest) -> dict:
    return {
        "torch": m.toolchain.torch,
        "graphs": {g.name: g.ir_sha256 for g in sorted(m.graphs, key=lambda g: g.name)},
        "weights": {f"rank{w.rank}": w.sha256 for w in m.weights},
        "tokenizer": {t.path: t.sha256 for t in m.tokenizer},
    }


def read_lock(path: Path) -> dict:
    if path.exists() and not path.is_file():
        raise OptionError(f"{path}: not a file (a lock file is JSON)")
    if not path.is_file():
        return {"schema": LOCK_SCHEMA, "entries": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise OptionError(f"{path}: not a valid lock file ({e})") from None
    if not isinstance(data, dict):
        raise OptionError(f"{path}: not a valid lock file (expected a JSON object)")
    if data.get("schema") != LOCK_SCHEMA:
        raise OptionError(f"{path}: lock schema {data.get('schema')!r}, expected {LOCK_SCHEMA}")
    entries = data.get("entries")
    if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
        raise OptionError(f"{path}: not a valid lock file ('entries' must map configurations to objects)")
    return data


def update_lock(m: Manifest, path: Path) -> str:
    data = read_lock(path)
    key = lock_key(m)
    data["entries"][key] = lock_entry(m)
    data["entries"] = dict(sorted(data["entries"].items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return key


def check_lock(m: Manifest, path: Path) -> list[str]:
    """Readable differences between this artifact and its lock entry (empty: it matches)."""
    data = read_lock(path)
    key = lock_key(m)
    want = data["entries"].get(key)
    if want is None:
        return [f"no lock entry for [{key}] in {path} (add it deliberately with --update-lock {path})"]
    got = lock_entry(m)
    diff: list[str] = []
    if want.get("torch") != got["torch"]:
        diff.append(f"toolchain  torch {want.get('torch')} in the lock, {got['torch']} here "
                    f"(graph hashes are only comparable on the same torch)")
    for section, label in (("graphs", "graph"), ("weights", "weights"), ("tokenizer", "tokenizer")):
        a, b = want.get(section, {}), got[section]
        if not isinstance(a, dict):
            raise OptionError(f"{path}: not a valid lock file (entry [{key}] '{section}' is not an object)")
        for name in sorted(set(a) | set(b)):
            if name not in b:
                diff.append(f"vanished  {label} {name}")
            elif name not in a:
                diff.append(f"appeared  {label} {name} {b[name][:16]}")
            elif a[name] != b[name]:
                diff.append(f"changed   {label} {name} {str(a[name])[:16]} -> {b[name][:16]}")
    return diff
