"""Compiled regions for the decode step. torch.compile runs on the pieces of a decoder layer that
every layer shares, instead of on the whole model's forward.

    regions = CompiledRegions(model)     # nothing compiles yet
    with regions.active():               # while a decode step is captured as a CUDA graph
        logits = decoder.forward(...)

Compiling the whole forward traces all of its layers as one graph. At 1.5B (28 layers) the first
call took 37.7 s, most of a fresh start-up's evaluation. The layers share their code and shapes,
so a region compiled once serves every layer. The regions are:
- each layer's children except its attention, that is the MLP and the norms (the attention reads
  the KV slab by its layer's index, so it would compile once per layer);
- the final norm;
- the rotary-embedding function that the attention's module calls.
On an H200 at 1.5B with 512 rows x 256 tokens, the first call took 6.5 s, and a decode call took
1.38 s against 1.36 s with the whole forward compiled (benchmarks/RESULTS.md, 2026-11-30). The
regions are swapped in only while `active`. Prefill, whose shapes change with every call, runs
the modules eagerly. The layers are the classes that the model lists in `_no_split_modules`. A
model that lists none has no regions, and the Decoder then compiles its whole forward, as before.
"""

import sys
from contextlib import contextmanager

import torch

ROTARY = "apply_rotary_pos_emb"  # the rotary function's name in HF's Llama-family attention


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
        # Find the rotary function in the module namespace where the attention looks it up at
        # each call.
        self._rotary = {}
        for layer in layers:
            attention = getattr(layer, "self_attn", None)
            home = sys.modules[type(attention).__module__].__dict__ if attention else {}
            if callable(home.get(ROTARY)) and id(home) not in self._rotary:
                # If another Decoder's regions are active now, the global is their compiled
                # function: keep the eager function that it wraps.
                original = getattr(home[ROTARY], "_torchdynamo_orig_callable", home[ROTARY])
                self._rotary[id(home)] = (home, original, torch.compile(original, dynamic=False))
        # Dynamo may keep a cache entry for each module instance that runs the same code. Raise
        # the limit so that the 9th layer does not fall back to eager.
        limit = torch._dynamo.config.cache_size_limit
        torch._dynamo.config.cache_size_limit = max(limit, 2 * len(self.modules) + 8)

    def __len__(self) -> int:
        return len(self.modules) + len(self._rotary)

    @contextmanager
    def active(self):
        """Swap the compiled regions in for the eager ones, and restore the eager ones after.
        The rotary function is a global of the attention's module. Meanwhile, another model of
        the same family in this process would call the compiled function too, which computes
        the same result."""
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
