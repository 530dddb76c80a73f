"""Optional dependency groups (pyproject.toml extras) and the one error a missing group raises.

    cpufuse[llama]  gguf, tokenizers, jinja2             (cpufuse.llama: models, tokenizer, chat)
    cpufuse[serve]  the llama group + uvicorn, starlette, pydantic   (cpufuse.serve, `serve`)
    cpufuse[ray]    the serve group + ray[serve]          (cpufuse.serve.ray: replicas on Ray Serve)

`require(extra)` is called where a group is first needed (the import of cpufuse.llama, of
cpufuse.serve); it checks that the modules the code imports can be found, without importing them.
`gguf` is in the llama group for writing GGUF files (tests, bench) and as a reference; loading a
model does not need it (cpufuse reads GGUF itself), so it is not checked. `llguidance` (llama group
too) is needed only for constrained output and tools (cpufuse.llama.constrain): it is imported when
a request asks for a constraint, and its absence is an ImportError naming the install command then.
"""
import importlib.util

EXTRAS = {
    "llama": ("gguf", "tokenizers", "jinja2"),
    "serve": ("gguf", "tokenizers", "jinja2", "uvicorn", "starlette", "pydantic"),
    "ray": ("gguf", "tokenizers", "jinja2", "uvicorn", "starlette", "pydantic", "ray"),
}


# what the code of each group imports (checked by require): the groups less gguf
NEEDED = {k: tuple(m for m in v if m != "gguf") for k, v in EXTRAS.items()}


class MissingExtra(ImportError):
    """A package of an optional group is not installed; the message names the pip command."""


def missing(extra):
    out = []
    for mod in NEEDED[extra]:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(mod)
    return out


def require(extra, what):
    """Raise MissingExtra naming `what`, the missing packages and `pip install cpufuse[extra]`."""
    gone = missing(extra)
    if gone:
        raise MissingExtra(f"{what} needs the optional packages {', '.join(NEEDED[extra])}; missing: "
                           f"{', '.join(gone)}. Install them with: pip install cpufuse[{extra}]",
                           name=gone[0])
