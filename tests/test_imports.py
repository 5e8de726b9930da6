"""The package's import graph has no circles and the core imports nothing of the bench: every module's
imports read with `ast` (memzoo/, bench/ as memzoo.bench): function-level ones, the packages an import
runs first, and importlib's (a literal name; ``f"{__name__}.{...}"``: every module of the package)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"memzoo": "memzoo", "memzoo.bench": "bench"}
#: the modules whose importlib calls name modules known only at run time, and why
RUNTIME_IMPORTS = {"memzoo.registry": "the plugins named in MEMZOO_PLUGINS or by --plugin: modules outside memzoo"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _imported(node, m: str, here: list[str], mods: dict) -> list[str] | None:
    """The modules an import statement or importlib call names (None: not an import; ["?"]: a name
    known only at run time)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = ".".join(here[: len(here) - node.level + 1] + [node.module or ""]).strip(".") if node.level else node.module
        return [base, *(f"{base}.{a.name}" for a in node.names)]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
        arg = node.args[0] if node.args else None
        if isinstance(arg, ast.Constant):
            return [arg.value]
        if isinstance(arg, ast.JoinedStr) and ast.unparse(arg).startswith("f'{__name__}."):
            pkg = ".".join(here)
            return [x for x in mods if x.rpartition(".")[0] == pkg]
        return ["?"]
    return None


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        here = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            targets = _imported(node, m, here, mods)
            for t in targets or ():
                if t == "?":
                    assert m in RUNTIME_IMPORTS, f"{m}: an importlib call whose module is not a literal"
                    continue
                while t and t not in mods:  # a name inside a module: the module
                    t = t.rpartition(".")[0]
                while t:  # the module, then the packages that importing it runs first (but m's own)
                    if t != m and not m.startswith(t + "."):
                        edges[m].add(t)
                    t = t.rpartition(".")[0]
    return edges


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_graph_reader_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    g = graph()
    assert "memzoo.registry" in g["memzoo.backbone.model"]  # function-level and from-imports are read
    assert "memzoo.layers.ba" in g["memzoo.layers"]  # the layers' autoloader: importlib over its own modules
    assert "memzoo.layers" in g["memzoo.registry"] and "memzoo.layers" not in g["memzoo.layers.ba"]  # a package an
    # import runs first counts, but not the importer's own


def test_no_import_circles():
    assert circles(graph()) == []


def test_the_core_imports_nothing_of_the_bench():
    """Layers, ops, modules, backbone, data, the trainer and the core command line import no module
    of memzoo.bench (the bench registers its verbs with the core's command: memzoo.bench.cli)."""
    edges = graph()
    core = [m for m in edges if not (m == "memzoo.bench" or m.startswith("memzoo.bench."))]
    assert [(m, t) for m in core for t in sorted(edges[m]) if t.startswith("memzoo.bench")] == []


def test_the_report_imports_no_torch():
    """Rendering rows needs no torch and no trainer: `memzoo.bench.report` and its suites' halves
    import none (what they share with the suites lives in memzoo.bench.schema)."""
    import subprocess
    import sys

    code = ("import sys\nimport memzoo.bench.report as r\nfrom memzoo.bench.report import cost, niah, overview, ppl, site, toys\n"
            "from memzoo.bench import verify\nassert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_command_line_renders_and_helps_without_torch(tmp_path):
    """`memzoo --help` and `memzoo leaderboard` import no torch (nor the trainer): rows to Markdown
    is a torch-free path (a few published rows, rendered in a fresh interpreter)."""
    import subprocess
    import sys

    rows = (ROOT / "leaderboards" / "results.jsonl").read_text().splitlines()[:3]
    (tmp_path / "results.jsonl").write_text("\n".join(rows) + "\n")
    code = ("import sys\nfrom memzoo.bench.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"assert main(['leaderboard', '--out', {str(tmp_path)!r}]) == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "README.md").is_file()


def test_the_families_read_from_source_are_the_classes_families():
    """`builtin_families` (the leaderboard's family column, read without importing the layers) says
    what every built-in layer's class says, and names every built-in layer."""
    import memzoo.layers  # noqa: F401  (registers the built-in layers)
    from memzoo.registry import _LAYERS, builtin_families

    builtin = {n: c for n, c in _LAYERS.items() if c.__module__.startswith("memzoo.layers.")}
    assert builtin_families() == {n: c.family for n, c in builtin.items()}
