"""The package's imports have no circle.

An AST walk over every module of cpufuse/ collects the modules each one imports: `import a.b`,
`from .x import y` (y itself when it is a submodule), imports inside functions too, and the imports
that a name search would miss, importlib.import_module("cpufuse....") and
importlib.util.spec_from_file_location(..., path) with the path written as string pieces. A circle
in that graph is an order the interpreter resolves only by accident of which module is imported
first; the test names each circle it finds. (An edge to a module's own package is not counted: every
module imports its packages first.)
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "cpufuse")

# (importer, imported) edges left out of the graph: none now; an entry here hides a circle.
KNOWN = set()


def modules(root=PKG):
    """{dotted name: path} of every .py under root (a package's __init__ is the package's name)"""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(d, f)
    return out


def _strings(node):
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def imports_of(name, path, mods):
    """the modules of mods that the module `name` (its source at path) imports"""
    tree = ast.parse(open(path).read(), path)
    is_pkg = os.path.basename(path) == "__init__.py"
    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()

    def add(target, names=()):
        subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods]
        if subs:
            found.update(subs)
        if target in mods and (len(subs) < len(names) or not names):
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            add(target, [a.name for a in node.names])
        elif isinstance(node, ast.Call):
            fn = node.func
            attr = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if attr == "import_module" and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    add(arg.value)
                elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                    prefix = arg.values[0].value   # f"cpufuse.numba.{x}": any module under the prefix
                    found.update(m for m in mods if m.startswith(prefix) and m != name)
            elif attr == "spec_from_file_location":
                parts = _strings(node)
                if parts and parts[-1].endswith(".py"):
                    for i in range(len(parts)):
                        rel = os.path.normpath(os.path.join(*parts[i:]))
                        for d in (os.path.dirname(path), ROOT):
                            cand = os.path.normpath(os.path.join(d, rel))
                            found.update(m for m, p in mods.items() if os.path.normpath(p) == cand)
    # A module's own packages are initialised before it runs, whatever it imports: an edge to an
    # ancestor (`from . import _native`, a compiled module the walk does not see) is implied for every
    # module and is no circle of the source.
    return {m for m in found if m != name and not name.startswith(m + ".")}


def import_graph():
    mods = modules()
    return {m: {t for t in imports_of(m, p, mods) if (m, t) not in KNOWN} for m, p in mods.items()}


def circles(graph):
    """the strongly connected components of more than one module (Tarjan), each sorted"""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_walk_sees_every_import_form(tmp_path):
    """the walk finds plain, relative, in-function, import_module and spec_from_file_location imports"""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("import importlib\ndef f():\n    return importlib.import_module('p.b')\n")
    (pkg / "b.py").write_text("import importlib.util, os\n"
                              "s = importlib.util.spec_from_file_location('c', os.path.join(os.path.dirname(__file__), 'c.py'))\n")
    (pkg / "c.py").write_text("def g():\n    from .a import f\n    return f\n")
    global ROOT
    saved, ROOT = ROOT, str(tmp_path)
    try:
        mods = modules(str(pkg))
        graph = {m: imports_of(m, p, mods) for m, p in mods.items()}
    finally:
        ROOT = saved
    assert graph == {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}
    assert circles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 50 and "cpufuse._layouts" in graph["cpufuse.graph.kinds"]
    found = circles(graph)
    assert not found, f"import circles in cpufuse/: {found}"
