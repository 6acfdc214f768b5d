"""The artifact manifest: the only contract between compile/ and runtime/ (typed, versioned, exact JSON)."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import serde
from .errors import ArtifactError
from .model_config import ModelConfig

SCHEMA_VERSION = 4          # 2: compile.moe_path (grouped | static); 3: packed prefill (context_starts input);
                            # 4: the root hash covers graph entries whole and the toolchain
MANIFEST_FILE = "manifest.json"

# Step kinds: prompt-as-decode (small T, one block-table row per token)
# and prefill-chunk (large T, one sequence's chunk; MoE grouped, or capacity-grouped on the static path).
DECODE = "decode"
PREFILL = "prefill"

# Regions: a graph is one region at one bucket, reused for every layer with that layer's weights.
EMBED = "embed"
DENSE_LAYER = "dense_layer"
MOE_LAYER = "moe_layer"
MOE_DENSE = "moe_dense"      # the MoE half alone, dense path: the rerun after a capacity overflow (static path)
HEAD = "head"


@dataclass(frozen=True)
class CompileConfig:
    backend: str                       # cpu | eager | cuda | neuron
    dtype: str                         # float32 | bfloat16
    cp: int
    ep: int
    decode_buckets: tuple[int, ...]    # token counts of prompt-as-decode graphs
    prefill_buckets: tuple[int, ...]   # token counts of prefill-chunk graphs
    context_buckets: tuple[int, ...]   # attention context lengths (multiples of block_size), last = limit
    context_limit: int
    block_size: int
    num_kv_blocks: int                 # the whole pool, all CP ranks together
    moe_capacity: tuple[int, ...]      # per prefill bucket: tokens one expert takes at most
    capacity_factor: float | None
    moe_decode_path: str = "auto"      # static path and CPU decode: dense | gather | auto (gather: T*top_k < E)
    moe_path: str = "static"           # grouped: exact grouped GEMMs, every bucket | static: capacity + dense/gather
    neuron_target: str | None = None
    # The weight matrices' storage dtype where it differs from dtype (CPU: bfloat16 weights, float32 math); None:
    # dtype, and then absent from the JSON, so manifests without it (older ones) keep their bytes and root hash.
    weight_dtype: str | None = field(default=None, metadata={"omit_if_none": True})
    # --matmul-dtype bfloat16 (CPU, bf16 weights): multi-row products read bf16 operands and sum in fp32 (2-3x the
    # fp32 FLOP rate on CPUs with bf16 dot products); None: float32 products, absent from the JSON like weight_dtype.
    matmul_dtype: str | None = field(default=None, metadata={"omit_if_none": True})
    # --region-marks: timing points between each layer graph's parts (attention, MoE or MLP, collectives) for
    # DEEPINFER_REGION_TIMING; None: no marks, absent from the JSON like weight_dtype.
    region_marks: bool | None = field(default=None, metadata={"omit_if_none": True})
    # --shared-experts grouped: each rank's shared experts are more groups of the routed experts' weights and GEMMs
    # (one grouped GEMM a projection for all of a layer's experts); None: a separate MLP, absent from the JSON.
    shared_experts_grouped: bool | None = field(default=None, metadata={"omit_if_none": True})

    @property
    def weights_dtype(self) -> str:
        """The storage dtype of the weight matrices (norms, the router and rank tensors keep theirs)."""
        return self.weight_dtype or self.dtype

    @property
    def world(self) -> int:
        return max(self.cp, self.ep)

    def shared_groups(self, m) -> int:
        """Shared experts each rank holds as groups of its experts' weights (0: a separate MLP)."""
        return m.n_shared_experts // self.ep if self.shared_experts_grouped else 0

    @property
    def kv_blocks_per_rank(self) -> int:
        return self.num_kv_blocks // self.cp

    @property
    def max_blocks_per_seq(self) -> int:
        return self.context_limit // self.block_size

    def prefill_seqs(self, tokens: int) -> int:
        """Sequences one prefill chunk of `tokens` may pack (the logit rows of its packed head graph): at most
        every sequence that can run at once, which is the largest decode bucket."""
        return min(tokens, max(self.decode_buckets))


@dataclass(frozen=True)
class RankLayout:
    rank: int
    cp_rank: int
    ep_rank: int
    experts: tuple[int, int]           # [first, last) global routed-expert ids held by this rank
    shared_slice: tuple[int, int]      # [first, last) of the shared experts' intermediate dimension
    kv_blocks: int                     # local pool size (blocks), trash block not counted


@dataclass(frozen=True)
class Layout:
    world: int
    cp: int
    ep: int
    kv_ownership: str                  # the rule that maps a global KV block to (rank, local block)
    ranks: tuple[RankLayout, ...]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class WeightArg:
    key: str                           # the name the graph takes it by
    source: str                        # the shard tensor name; '{layer}' is filled in per layer
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class GraphEntry:
    name: str                          # e.g. "moe_layer.prefill.t128.c512"
    region: str
    kind: str                          # decode | prefill
    tokens: int
    context: int                       # attention context (0 for regions without attention)
    file: str                          # relative to the artifact root
    ir_sha256: str                     # hash of the canonical exported program (machine independent)
    graph_hash: str                    # ir_sha256 combined with backend, dtype and toolchain
    file_sha256: str                   # hash of the compiled file as written (machine specific)
    inputs: tuple[TensorSpec, ...]     # step inputs, in call order
    weights: tuple[WeightArg, ...]     # weight tensors the graph takes, in call order
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class FileEntry:
    path: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class WeightShard:
    rank: int
    path: str
    sha256: str
    bytes: int
    num_tensors: int


@dataclass(frozen=True)
class Toolchain:
    torch: str
    python: str
    backend: str
    target: str                        # CPU ISA / GPU arch / Neuron target
    compiler: str                      # AOTInductor / inductor / neuronx-cc version


@dataclass(frozen=True)
class RankMemory:
    rank: int
    weights_bytes: int
    kv_pool_bytes: int
    activations_bytes: int

    @property
    def total(self) -> int:
        return self.weights_bytes + self.kv_pool_bytes + self.activations_bytes


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    name: str
    model: ModelConfig
    compile: CompileConfig
    layout: Layout
    graphs: tuple[GraphEntry, ...]
    weights: tuple[WeightShard, ...]
    tokenizer: tuple[FileEntry, ...]
    toolchain: Toolchain
    memory: tuple[RankMemory, ...]
    root_hash: str = ""

    def graph(self, region: str, kind: str, tokens: int, context: int = 0) -> GraphEntry:
        for g in self.graphs:
            if (g.region, g.kind, g.tokens, g.context) == (region, kind, tokens, context):
                return g
        raise ArtifactError(f"manifest has no graph for region={region} kind={kind} tokens={tokens} context={context}")

    def compute_root_hash(self) -> str:
        """One hash over everything that defines the artifact: graphs (what the runtime reads of each entry: its
        file, inputs, weights and outputs), weights, tokenizer, config, toolchain. The compiled files' own hashes
        are left out (machine specific; the files are checked against them at load)."""
        h = hashlib.sha256()
        h.update(serde.dumps(self.model).encode())
        h.update(serde.dumps(self.compile).encode())
        h.update(serde.dumps(self.layout).encode())
        h.update(serde.dumps(self.toolchain).encode())
        for g in sorted(self.graphs, key=lambda g: g.name):
            h.update(f"{serde.dumps(dataclasses.replace(g, file_sha256=''))}\n".encode())
        for w in sorted(self.weights, key=lambda w: w.rank):
            h.update(f"weights{w.rank}:{w.sha256}\n".encode())
        for t in sorted(self.tokenizer, key=lambda t: t.path):
            h.update(f"{t.path}:{t.sha256}\n".encode())
        return h.hexdigest()

    def dumps(self) -> str:
        return serde.dumps(self)

    @classmethod
    def loads(cls, text: str, where: str = MANIFEST_FILE) -> "Manifest":
        import json
        try:
            data = json.loads(text)
        except ValueError as e:        # (a JSONDecodeError, or an integer past int()'s 4300 digits)
            raise ArtifactError(f"{where}: not valid JSON ({e}); the manifest is damaged") from None
        except RecursionError:
            raise ArtifactError(f"{where}: nested too deeply to be a manifest; the manifest is damaged") from None
        if not isinstance(data, dict):
            raise ArtifactError(f"{where}: not a JSON object; the manifest is damaged")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ArtifactError(f"{where}: schema_version={version!r}, this deepinfer reads {SCHEMA_VERSION}; "
                                f"recompile the artifact")
        m = serde.loads(cls, text, where)
        m._check(where)
        return m

    def _check(self, where: str) -> None:
        """What the types leave open and the runtime relies on (a manifest edited with its hashes rewritten): sizes
        that divide or index, known dtypes, and files inside the artifact."""
        c = self.compile

        def bad(what: str) -> ArtifactError:
            return ArtifactError(f"{where}: {what}; the manifest is damaged")
        for name in ("dtype", "weight_dtype", "matmul_dtype"):
            if getattr(c, name) not in (("float32", "bfloat16") if name == "dtype" else (None, "float32", "bfloat16")):
                raise bad(f"compile.{name}={getattr(c, name)!r} is not float32 or bfloat16")
        for name in ("cp", "ep", "block_size", "num_kv_blocks", "context_limit"):
            if getattr(c, name) < 1:
                raise bad(f"compile.{name}={getattr(c, name)} must be at least 1")
        for name in ("decode_buckets", "prefill_buckets", "context_buckets"):
            b = getattr(c, name)
            if (not b and name != "prefill_buckets") or any(x < 1 for x in b) or list(b) != sorted(set(b)):
                raise bad(f"compile.{name}={list(b)} must be distinct positive sizes in increasing order")
        if c.context_buckets[-1] != c.context_limit:
            raise bad(f"compile.context_limit={c.context_limit} is not the last context bucket "
                      f"{c.context_buckets[-1]}")
        for rel in [g.file for g in self.graphs] + [w.path for w in self.weights] + [t.path for t in self.tokenizer]:
            p = PurePosixPath(rel)
            if p.is_absolute() or ".." in p.parts or "\\" in rel:
                raise bad(f"file {rel!r} is not inside the artifact")

    @classmethod
    def read(cls, artifact_dir: str | Path) -> "Manifest":
        path = Path(artifact_dir) / MANIFEST_FILE
        if not path.is_file():
            raise ArtifactError(f"{path}: no manifest (not a complete deepinfer artifact; "
                                f"was the compile interrupted?)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ArtifactError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); the manifest is damaged") \
                from None
        except OSError as e:
            raise ArtifactError(f"{path}: cannot be read ({e.strerror or e})") from None
        return cls.loads(text, str(path))


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def graph_name(region: str, kind: str, tokens: int, context: int = 0, logit_rows: int = 1) -> str:
    """The one naming rule for graphs; compile writes it, the runtime looks graphs up by it. Prefill heads come
    in two sizes: one logits row (a chunk of one prompt) and one per packed sequence (`.l<rows>`)."""
    if region in (EMBED, MOE_DENSE):
        return f"{region}.t{tokens}"
    if region == HEAD:
        return f"{region}.{kind}.t{tokens}" + (f".l{logit_rows}" if kind == PREFILL and logit_rows > 1 else "")
    return f"{region}.{kind}.t{tokens}.c{context}"


def neuron_state_name(key: str) -> str:
    """The module-state name a Neuron graph holds weight `key` under (weights are state, not NEFF constants)."""
    return "w_" + key.replace(".", "__")


NEURON_PENDING = "neuronx-cc (pending: finish on a Neuron host)"
