"""The architectures cpufuse.llama runs: one module each in this package, each declaring one
`spec.Arch` named ARCH (its GGUF keys and defaults, its tensors, its forward built from the shared
blocks of blocks.py). Modules are found here at import, so adding an architecture is adding its
module (docs/architectures.md).

    REGISTRY["gemma3"]       # the Arch of general.architecture "gemma3"
    SUPPORTED                # their names, in the order they were added

The loader (loader.py), the hyperparameters (hparams.py), the decoder (decoder.py), the tiny-model
writer (tiny.py) and the command line all read REGISTRY.
"""
from __future__ import annotations

import importlib
import pkgutil

from .spec import Arch

__all__ = ["REGISTRY", "SUPPORTED", "Arch", "get"]


def _discover():
    found = []
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("_") or mod.name in ("spec", "blocks"):
            continue
        a = getattr(importlib.import_module(f"{__name__}.{mod.name}"), "ARCH", None)
        if isinstance(a, Arch):
            found.append(a)
    found.sort(key=lambda a: (a.rank, a.name))
    return {a.name: a for a in found}


REGISTRY = _discover()
SUPPORTED = tuple(REGISTRY)


def get(name):
    """the Arch of general.architecture `name`; ValueError naming it and the supported ones"""
    a = REGISTRY.get(name)
    if a is None:
        raise ValueError(f"architecture {name!r} is not supported by cpufuse.llama "
                         f"(supported: {', '.join(SUPPORTED)})")
    return a
