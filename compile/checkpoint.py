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
            self._read_index(index)
        else:
            for f in sorted(self.path.glob("*.safetensors")):
                for name in self._open(f).keys():
                    if name in self._where:
                        raise CheckpointError(f"{f}: tensor '{name}' also appears in {self._where[name].name}")
                    self._where[name] = f
        if require_weights and not self._where:
            raise CheckpointError(f"{self.path}: no *.safetensors weights found "
                                  f"(use a shape-only compile to build without weights)")
        self._skip_mtp_layers()

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise CheckpointError(f"{index}: unreadable index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        for name, file in weight_map.items():
            if not isinstance(file, str) or not (self.path / file).is_file():
                raise CheckpointError(f"{index}: tensor '{name}' points to missing file {file!r}")
            self._where[name] = self.path / file
        by_file: dict[Path, list[str]] = {}
        for name, f in self._where.items():
            by_file.setdefault(f, []).append(name)
        for f, names in sorted(by_file.items()):     # headers only: a wrong map fails here, not mid-compile
            held = set(self._open(f).keys())
            missing = [n for n in names if n not in held]
            if missing:
                raise CheckpointError(f"{index}: tensor '{missing[0]}' is mapped to {f.name}, which does not hold it"
                                      + (f" ({len(missing) - 1} more like it)" if len(missing) > 1 else ""))

    def _skip_mtp_layers(self) -> None:
        """The multi-token-prediction layers (num_hidden_layers .. + num_nextn_predict_layers - 1) are skipped on
        purpose; a layer past them means config.json's num_hidden_layers is smaller than the checkpoint's."""
        L, nextn = self.config.num_hidden_layers, self.config.num_nextn_predict_layers
        layer = re.compile(r"^model\.layers\.(\d+)\.")
        for name in sorted(self._where):
            mm = layer.match(name)
            if not mm or int(mm.group(1)) < L:
                continue
            if int(mm.group(1)) >= L + nextn:
                raise CheckpointError(
                    f"{self.path}: tensor '{name}' belongs to layer {mm.group(1)}, past the model's {L} layers "
                    f"(config.json num_hidden_layers) and {nextn} multi-token-prediction layer(s) "
                    f"(num_nextn_predict_layers): the config does not describe these weights")
            self.skipped.append(name)
            del self._where[name]
        self.notes = [_MTP_NOTE.format(n=L)] if self.skipped else []

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
        elif not t.is_floating_point():
            raise CheckpointError(f"{self.path}: tensor '{name}' is stored as {str(t.dtype).removeprefix('torch.')}; "
                                  f"weights are read as float32, bfloat16, float16 or FP8 with block scales")
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
        if t.dim() != 2:
            raise CheckpointError(f"{self.path}: FP8 tensor '{name}' has shape {tuple(t.shape)}; block scales "
                                  f"apply to 2-D weight matrices only")
        scale = self._open(self._where[scale_name]).get_tensor(scale_name).float()
        rows, cols = t.shape
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != want:
            raise CheckpointError(f"{self.path}: '{scale_name}' has shape {tuple(scale.shape)}, "
                                  f"expected {want} for {block[0]}x{block[1]} blocks of '{name}' {tuple(t.shape)}")
        s = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        return t.float() * s
