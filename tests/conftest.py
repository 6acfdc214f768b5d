"""Shared fixtures: tiny checkpoints built with transformers, compiled once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import VARIANTS, make_checkpoint  # noqa: E402

# Tiny models: one intra-op thread avoids OpenMP spin-waits when the machine is shared (2x-40x slower otherwise).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: make_checkpoint(root / name, seed=i, **over) for i, (name, over) in enumerate(VARIANTS.items())}


@pytest.fixture(scope="session")
def bf16_checkpoint(tmp_path_factory) -> Path:
    """The base tiny model saved in bfloat16, as real DeepSeek checkpoints ship."""
    return make_checkpoint(tmp_path_factory.mktemp("checkpoints") / "bf16", seed=7, dtype=torch.bfloat16)


_artifacts: dict[tuple, Path] = {}


@pytest.fixture(scope="session")
def compile_artifact(tmp_path_factory, cache_dir):
    """compile_artifact(checkpoint, **options) -> artifact dir, memoised per session."""
    from deepinfer.compile.driver import compile_artifact as do_compile
    from deepinfer.compile.options import CompileOptions

    def build(model: Path, **kw) -> Path:
        key = (str(model), tuple(sorted(kw.items())))
        if key not in _artifacts:
            out = tmp_path_factory.mktemp("artifact")
            opts = dict(backend="eager", decode_buckets=(1, 4), prefill_buckets=(32,), context_limit=128,
                        context_buckets=(64,), jobs=2)
            opts.update(kw)
            do_compile(CompileOptions(model=Path(model), out=out, cache_dir=cache_dir, **opts), log=lambda s: None)
            _artifacts[key] = out
        return _artifacts[key]

    return build
