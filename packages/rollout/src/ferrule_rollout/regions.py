"""The decode step's compiled regions: torch.compile on the pieces of a decoder layer that every
layer shares, instead of on the whole model's forward.

    regions = CompiledRegions(model)     # nothing compiles yet
    with regions.active():               # while a decode step is captured as a CUDA graph
        logits = decoder.forward(...)

Compiling the whole forward traces all of its layers as one graph: at 1.5B (28 layers) the first
call took 37.7 s, most of a fresh start-up's evaluation. The layers share their code and shapes,
so a region compiled once serves every layer: each layer's children except its attention (the
MLP and the norms; the attention reads the KV slab by its layer's index, which would compile once
a layer) and the final norm, plus the rotary embedding's function of the attention's module. On
an H200 at 1.5B, 512 rows x 256 tokens: the first call 6.5 s, a decode call 1.38 s against the
whole forward's 1.36 s (benchmarks/RESULTS.md, 2026-11-30). The regions are swapped in only
while `active`: prefill, whose shapes change with every call, runs them eagerly. The layers are
the classes the model lists in `_no_split_modules`; a model that lists none has no regions (the
Decoder then compiles its whole forward, as before).
"""

import sys
from contextlib import contextmanager

import torch

ROTARY = "apply_rotary_pos_emb"  # what HF's Llama-family attention modules call by this name


class CompiledRegions:
    def __init__(self, model: torch.nn.Module):
        names = set(getattr(model, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in names]
        self.modules = [
            child
            for layer in layers
            for name, child in layer.named_children()
            if name != "self_attn"
        ]
        norm = getattr(getattr(model, "model", None), "norm", None)
        if layers and isinstance(norm, torch.nn.Module):
            self.modules.append(norm)
        self._compiled = [torch.compile(m.forward, dynamic=False) for m in self.modules]
        # the rotary function, in the namespace the attention looks it up in at each call
        self._rotary = {}
        for layer in layers:
            attention = getattr(layer, "self_attn", None)
            home = sys.modules[type(attention).__module__].__dict__ if attention else {}
            if callable(home.get(ROTARY)) and id(home) not in self._rotary:
                # made while another Decoder's regions are active: the eager function under them
                original = getattr(home[ROTARY], "_torchdynamo_orig_callable", home[ROTARY])
                self._rotary[id(home)] = (home, original, torch.compile(original, dynamic=False))
        # dynamo may keep an entry for each module instance of one code: not an eager fallback
        # at the 9th layer
        limit = torch._dynamo.config.cache_size_limit
        torch._dynamo.config.cache_size_limit = max(limit, 2 * len(self.modules) + 8)

    def __len__(self) -> int:
        return len(self.modules) + len(self._rotary)

    @contextmanager
    def active(self):
        """The compiled regions in place of the eager ones, and the eager ones back after. The
        rotary function is the attention module's global: another model of the same family in
        this process would meet the compiled one meanwhile (it computes the same)."""
        kept = [m.__dict__.get("forward") for m in self.modules]
        for module, compiled in zip(self.modules, self._compiled, strict=True):
            module.forward = compiled
        for home, _, compiled in self._rotary.values():
            home[ROTARY] = compiled
        try:
            yield
        finally:
            for module, own in zip(self.modules, kept, strict=True):
                if own is None:
                    del module.forward
                else:
                    module.forward = own
            for home, original, _ in self._rotary.values():
                home[ROTARY] = original
