"""The import arrows run one way: models <- parallel <- optim <- runtime <- launch, and inside optim/ and
benchmarks/ as the folders say. Read from the source with `ast` (no import executed), every import
counted, those inside functions too.

Rules (each holds on the tree today; `RULES` is the whole list):
  models/            imports none of parallel, optim, runtime, launch, benchmarks
  parallel/          imports none of optim, runtime, launch, benchmarks
  optim/             imports none of runtime, launch, benchmarks
  optim/*.py         (NS, reference Muon, AdamW, config, QK-clip) imports neither optim.planner nor optim.sharded
  optim/planner/     does not import optim.sharded (the planner is pure; the optimizer uses it)
  runtime/           imports neither launch nor benchmarks
  launch/            imports no benchmark script (benchmarks.lib only: launch/dry_run.py's counters)
  benchmarks/lib/    imports no benchmark script (the scripts use the helpers, never the reverse)
"""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("models", "parallel", "optim", "runtime", "launch", "benchmarks")
SCRIPTS = "benchmarks scripts"  # any benchmarks.X that is not under benchmarks.lib

# (modules the rule covers, forbidden module prefixes): a module is covered when its dotted name
# starts with the first entry (for "optim.*top": directly in optim/)
RULES = [
    ("models", ("parallel", "optim", "runtime", "launch", "benchmarks")),
    ("parallel", ("optim", "runtime", "launch", "benchmarks")),
    ("optim", ("runtime", "launch", "benchmarks")),
    ("optim.*top", ("optim.planner", "optim.sharded")),
    ("optim.planner", ("optim.sharded",)),
    ("runtime", ("launch", "benchmarks")),
    ("launch", (SCRIPTS,)),
    ("benchmarks.lib", (SCRIPTS,)),
]


def _module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)[: -len(".py")]
    parts = rel.split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: str) -> bool:
    base = os.path.join(root, *name.split("."))
    return os.path.exists(base + ".py") or os.path.isdir(base)


def _file_imports(path: str, root: str) -> set[str]:
    """First-party modules `path` imports (`from pkg import sub` counts as pkg.sub when sub is a module)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(s for s in (f"{node.module}.{a.name}" for a in node.names) if _is_module(s, root))
    return {n for n in names if n.split(".")[0] in PACKAGES}


def imports(root: str = REPO) -> dict[str, set[str]]:
    """Dotted module -> the first-party modules it imports, for every module of PACKAGES."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    found[_module_name(path, root)] = _file_imports(path, root)
    return found


def _covered(module: str, scope: str) -> bool:
    if scope == "optim.*top":
        return module.count(".") == 1 and module.startswith("optim.")
    return module == scope or module.startswith(scope + ".")


def _forbidden(name: str, prefix: str) -> bool:
    if prefix == SCRIPTS:
        return name.startswith("benchmarks.") and not (name + ".").startswith("benchmarks.lib.")
    return name == prefix or name.startswith(prefix + ".")


def violations(root: str = REPO) -> list[str]:
    """'module -> imported (rule scope)' for every import that breaks a rule."""
    bad = []
    for module, names in sorted(imports(root).items()):
        for scope, prefixes in RULES:
            if _covered(module, scope):
                bad += [f"{module} -> {n} ({scope})" for n in sorted(names) if any(_forbidden(n, p) for p in prefixes)]
    return bad


def test_imports_run_one_way():
    found = imports()
    # the scan sees the arrows that are allowed, so an empty violation list is not an empty scan
    assert "models.boxes" in found["models.hf.checkpoint"] and "models.boxes" in found["optim.planner.plan"]
    assert "optim.planner.plan" in found["optim.sharded.muon"] and "benchmarks.lib.harness" in found["benchmarks.optimizer_step"]
    assert len(found) > 100  # 135 modules when written
    assert violations() == []


def test_a_broken_arrow_is_reported(tmp_path):
    """A model module importing parallel/ and a helper importing a script are each named, with the rule."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "benchmarks" / "lib").mkdir()
    (tmp_path / "parallel" / "boxes.py").write_text("")
    (tmp_path / "benchmarks" / "gpu_check.py").write_text("")
    (tmp_path / "models" / "hf.py").write_text("def load():\n    from parallel.boxes import dtensor_box\n")
    (tmp_path / "benchmarks" / "lib" / "counters.py").write_text("from benchmarks import gpu_check\n")
    (tmp_path / "optim" / "planner").mkdir()
    (tmp_path / "optim" / "planner" / "plan.py").write_text("import optim.sharded.muon\n")
    assert violations(str(tmp_path)) == [
        "benchmarks.lib.counters -> benchmarks.gpu_check (benchmarks.lib)",
        "models.hf -> parallel.boxes (models)",
        "optim.planner.plan -> optim.sharded.muon (optim.planner)",
    ]


def test_no_test_module_imports_another():
    """Shared fixtures live in helper modules that are not test_*.py (tests/README.md)."""
    assert _test_modules_importing_tests(os.path.join(REPO, "tests")) == {}


def _test_modules_importing_tests(tests_dir: str) -> dict[str, list[str]]:
    """{test file: the test_* modules it imports}, read with `ast` like the rules above."""
    found = {}
    for f in sorted(os.listdir(tests_dir)):
        if f.startswith("test_") and f.endswith(".py"):
            with open(os.path.join(tests_dir, f)) as src:
                tree = ast.parse(src.read(), f)
            names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module in (None, "tests")
                      for a in n.names}
            hits = sorted(n for n in names if n.split(".")[-1].startswith("test_"))
            if hits:
                found[f] = hits
    return found


def test_a_test_importing_a_test_is_reported(tmp_path):
    (tmp_path / "test_a.py").write_text("from test_b import CASES\n")
    (tmp_path / "test_b.py").write_text("import parity_cases\nfrom tests import test_c\n")
    (tmp_path / "parity_cases.py").write_text("from test_a import x\n")  # helpers are not test modules
    assert _test_modules_importing_tests(str(tmp_path)) == {"test_a.py": ["test_b"], "test_b.py": ["test_c"]}
