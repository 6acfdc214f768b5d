"""Read a Hugging Face DeepSeek-V3 checkpoint directory lazily: config, safetensors (single or sharded), tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..common.errors import CheckpointError
from ..common.model_config import ModelConfig

_MTP_NOTE = ("multi-token-prediction layer tensors (model.layers.{n}.*) are skipped on purpose: "
             "deepinfer has no MTP lookahead")


class Checkpoint:
    """A checkpoint directory. Tensors are read one at a time, so memory stays bounded by the largest one."""

    def __init__(self, path: str | Path, require_weights: bool = True):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory (expected a checkpoint with config.json)")
        self.config = ModelConfig.from_file(self.path / "config.json")
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self.skipped: list[str] = []
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from None
            for name, file in weight_map.items():
                f = self.path / file
                if not f.is_file():
                    raise CheckpointError(f"{index}: tensor '{name}' points to missing file {file}")
                self._where[name] = f
        else:
            for f in sorted(self.path.glob("*.safetensors")):
                for name in self._open(f).keys():
                    if name in self._where:
                        raise CheckpointError(f"{f}: tensor '{name}' also appears in {self._where[name].name}")
                    self._where[name] = f
        if require_weights and not self._where:
            raise CheckpointError(f"{self.path}: no *.safetensors weights found "
                                  f"(use a shape-only compile to build without weights)")
        mtp = re.compile(rf"^model\.layers\.(\d+)\.")
        for name in list(self._where):
            mm = mtp.match(name)
            if mm and int(mm.group(1)) >= self.config.num_hidden_layers:
                self.skipped.append(name)
                del self._where[name]
        self.notes = [_MTP_NOTE.format(n=self.config.num_hidden_layers)] if self.skipped else []

    @property
    def has_weights(self) -> bool:
        return bool(self._where)

    @property
    def tokenizer_files(self) -> list[Path]:
        names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json"]
        return [self.path / n for n in names if (self.path / n).is_file()]

    def names(self) -> set[str]:
        return set(self._where)

    def _open(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error types for a bad header
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
            self._handles[f] = h
        return h

    def stored_matrix_dtype(self) -> str | None:
        """"bfloat16" when every weight matrix (2-D and up, the router's excepted) is stored in bf16, as
        real checkpoints ship them; else None (float32, mixed, or FP8 blocks, which dequantize to float32)."""
        seen = set()
        for name, f in self._where.items():
            if name.endswith(("mlp.gate.weight", "weight_scale_inv")):
                continue
            sl = self._open(f).get_slice(name)
            if len(sl.get_shape()) >= 2:
                seen.add(sl.get_dtype())
        return "bfloat16" if seen == {"BF16"} else None

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._where[name]).get_slice(name).get_shape())

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """One tensor, FP8 block-dequantized to float32 when it carries a `weight_scale_inv`."""
        if name not in self._where:
            raise CheckpointError(f"{self.path}: missing tensor '{name}'")
        t = self._open(self._where[name]).get_tensor(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t = self._dequant_fp8(name, t)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor '{name}' has shape {tuple(t.shape)}, "
                                  f"the config needs {tuple(shape)}")
        return t

    def _dequant_fp8(self, name: str, t: torch.Tensor) -> torch.Tensor:
        scale_name = name.replace(".weight", ".weight_scale_inv")
        if scale_name == name or scale_name not in self._where:
            raise CheckpointError(f"{self.path}: FP8 tensor '{name}' has no '{scale_name}' block scales; "
                                  f"refusing to load raw FP8 bytes")
        block = self.config.fp8_block_size or (128, 128)
        scale = self._open(self._where[scale_name]).get_tensor(scale_name).float()
        rows, cols = t.shape
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != want:
            raise CheckpointError(f"{self.path}: '{scale_name}' has shape {tuple(scale.shape)}, "
                                  f"expected {want} for {block[0]}x{block[1]} blocks of '{name}' {tuple(t.shape)}")
        s = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        return t.float() * s
