"""Running finished Neuron artifacts: one traced NEFF module per (graph, layer) on this rank's NeuronCore.

Weights and the layer's KV pool are the module's state (`torch_neuronx.replace_weights`), moved to the
core once (`torch_neuronx.move_trace_to_device`); each call then passes only the step's small tensors.
Written against the documented torch-neuronx API; not run here (no Neuron device was available).
"""

from __future__ import annotations

from ..common.errors import ArtifactError, BackendUnavailable
from ..common.manifest import NEURON_PENDING, GraphEntry, neuron_state_name

SDK_HINT = ("backend 'neuron' needs torch-neuronx and neuronx-cc from AWS's Neuron package repository "
            "(https://pip.repos.neuron.amazonaws.com) on a trn1/trn2/inf2 host; they are not installed here")


def require_sdk():
    try:
        import torch_neuronx  # type: ignore[import-not-found]
    except Exception as e:
        raise BackendUnavailable(f"{SDK_HINT} (import torch_neuronx failed: {type(e).__name__})") from None
    return torch_neuronx


def check_finished(art) -> None:
    m = art.manifest
    if m.toolchain.compiler == NEURON_PENDING or any(not g.file.endswith(".neff.pt") for g in m.graphs):
        raise ArtifactError(f"{art.root}: prepared for Neuron ({m.compile.neuron_target}) but the NEFFs are not "
                            f"built yet; on a Neuron host run: deepinfer-neuron-finish {art.root}")


class NeuronGraph:
    """Callable like the other backends' graphs (step tensors, kv_cache, weights); dispatches to the module
    instance that holds that layer's weights and KV pool as device state."""

    def __init__(self, art, g: GraphEntry, core: int):
        self.torch_neuronx = require_sdk()
        self.art, self.g, self.core = art, g, core
        self.by_weights: dict[int, object] = {}
        self.has_kv = any(t.name == "kv_cache" for t in g.inputs)

    def bind(self, weights: dict, kv_cache) -> None:
        """Load one instance of the NEFF module for a layer and make its weights and KV pool device state."""
        import torch
        mod = torch.jit.load(str(self.art.file(self.g.file)))
        state = {neuron_state_name(k): v for k, v in weights.items()}
        if self.has_kv:
            state["kv_cache_state"] = kv_cache
        self.torch_neuronx.replace_weights(mod, state)
        self.torch_neuronx.move_trace_to_device(mod, self.core)
        self.by_weights[id(weights)] = mod

    def __call__(self, *args):
        *step, weights = args
        if self.has_kv:
            del step[4]          # the KV pool lives on the device as the module's state
        return self.by_weights[id(weights)](*step)
