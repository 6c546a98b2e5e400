"""The package's import graph on the CPU: every import between cupyloss's modules, those inside
functions included (a lazy import is still a dependency), and no cycle among them.

A module is read with ``ast``, not imported, so that the graph is the one the code states.
"""

import ast
import pathlib

import cupyloss

ROOT = pathlib.Path(cupyloss.__file__).resolve().parent


def _modules() -> dict:
    """Dotted name -> source path of every module of the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def graph() -> dict:
    """Module -> the package's modules it imports (anywhere in its body)."""
    modules = _modules()
    edges = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module in modules:
                    subs = {f"{node.module}.{a.name}" for a in node.names}
                    found = subs & set(modules)
                    # `from cupyloss import x`: the submodule x where there is one (a name
                    # defined in the package's __init__ is a dependency on the package)
                    deps |= found or {node.module}
                    if len(found) < len(subs):
                        deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
        edges[name] = deps - {name}
    return edges


def _cycles(edges: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    edges = graph()
    cycles = _cycles(edges)
    described = ["; ".join(f"{m} -> {sorted(edges[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, described


def test_the_graph_sees_lazy_imports():
    """The graph holds an import made inside a function (torch's adapter loads its fused loss
    module only when a call needs it), so a cycle through one cannot hide."""
    edges = graph()
    assert "cupyloss.linear" in edges["cupyloss.torch"]
    assert "cupyloss.torch._parallel" in edges["cupyloss.torch"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_library_imports_no_command():
    """The benchmarks (cupyloss.bench) and maintenance commands (cupyloss.tools) sit on top of
    the library: no module outside them imports one of theirs."""
    edges = graph()
    commands = ("cupyloss.bench", "cupyloss.tools")
    library = [m for m in edges if not m.startswith(commands)]
    bad = {m: sorted(d for d in edges[m] if d.startswith(commands)) for m in library}
    assert not {m: d for m, d in bad.items() if d}
    assert any(m.startswith("cupyloss.bench.") for m in edges)    # the walk reaches them


def _defined(path: pathlib.Path) -> set:
    """The names a module's top level binds (defs, classes, assignments, imports), and for a
    package its submodules."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.glob("*.py")} | {
            p.name for p in path.parent.iterdir() if (p / "__init__.py").exists()}
    return names


def test_every_import_of_the_package_resolves():
    """Every `from cupyloss... import name` in the package, the tests and the examples, those
    inside functions included (the GPU paths' lazy imports, which no CPU test runs), names a
    module of the package and a name it binds, so that a module moved or renamed cannot leave
    an import behind that only a GPU would reach."""
    modules = _modules()
    here = pathlib.Path(__file__).resolve().parent      # tests/, beside examples/
    sources = list(ROOT.rglob("*.py")) + list(here.glob("*.py"))
    sources += list((here.parent / "examples").glob("*.py"))
    bound = {}
    bad = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "cupyloss":
                if node.module not in modules:
                    bad.append(f"{path.name}:{node.lineno}: no module {node.module}")
                    continue
                have = bound.setdefault(node.module, _defined(modules[node.module]))
                bad += [f"{path.name}:{node.lineno}: {node.module} binds no {a.name}"
                        for a in node.names if a.name != "*" and a.name not in have]
            elif isinstance(node, ast.Import):
                bad += [f"{path.name}:{node.lineno}: no module {a.name}" for a in node.names
                        if a.name.split(".")[0] == "cupyloss" and a.name not in modules]
    assert not bad, bad


def test_no_package_name_hides_a_submodule():
    """A name a package's __init__ binds itself (a def, a class, an assignment) that is also one
    of its submodules' names makes `from package import name` return one or the other by
    import order: the adapter's `_autocast` function once hid its autocast module."""
    clashes = []
    for init in ROOT.rglob("__init__.py"):
        subs = {p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"}
        subs |= {p.name for p in init.parent.iterdir() if (p / "__init__.py").exists()}
        for node in ast.parse(init.read_text()).body:
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            clashes += [f"{init.relative_to(ROOT.parent)}:{node.lineno} {n}" for n in names
                        if n in subs]
    assert not clashes, clashes


# Modules that bind names at import time (built from the registry), which ast cannot see.
_BUILT_AT_IMPORT = ("cupyloss.torch", "cupyloss.jax")


def _aliases(tree, modules) -> dict:
    """Local name -> the package module it stands for, from the imports anywhere in a file."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    out[a.asname or a.name] = full
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in modules:
                    out[a.asname] = a.name
    return out


def test_every_attribute_of_a_package_module_exists():
    """`_launch.row_launch(...)`: every attribute read from a name that stands for one of the
    package's modules (imported as `from cupyloss._core import launch as _launch`, anywhere in
    the file) is a name that module binds, so that moving a function between modules cannot
    leave a call behind that only a GPU path would reach."""
    modules = _modules()
    here = pathlib.Path(__file__).resolve().parent
    sources = list(ROOT.rglob("*.py")) + list(here.glob("*.py"))
    sources += list((here.parent / "examples").glob("*.py"))
    bound, bad = {}, []
    for path in sources:
        tree = ast.parse(path.read_text())
        aliases = {k: v for k, v in _aliases(tree, modules).items()
                   if v not in _BUILT_AT_IMPORT}
        assigned = {n.id for n in ast.walk(tree)
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.value.id not in assigned
                    and isinstance(node.ctx, ast.Load) and not node.attr.startswith("__")):
                module = aliases[node.value.id]
                have = bound.setdefault(module, _defined(modules[module]))
                if node.attr not in have:
                    bad.append(f"{path.name}:{node.lineno}: {module} binds no {node.attr}")
    assert not bad, bad
