"""The house's rules, read from the source with `ast` (no import executed; imports inside functions count).

Arrows (`RULES`: a module scope, the modules it must not import):
  models/ <- parallel/ <- optim/ <- runtime/ <- planning/ <- launch/ and benchmarks/, experiments/ on top
  models/             imports none of parallel, optim, runtime, planning, launch, benchmarks, experiments
  parallel/           imports none of optim, runtime, planning, launch, benchmarks, experiments
  optim/              imports none of runtime, planning, launch, benchmarks, experiments
  optim/*.py          (NS, reference Muon, AdamW, config, QK-clip) imports neither optim.planner nor optim.sharded
  optim/planner/      does not import optim.sharded (the planner is pure; the optimizer uses it)
  runtime/            imports none of planning, launch, benchmarks, experiments
  runtime/data/       imports none of runtime.posttrain, runtime.checkpoint, runtime.train (the lowest wing)
  runtime/checkpoint/ imports none of runtime.posttrain, runtime.data, runtime.train
  runtime/posttrain/  does not import runtime.train (the loop calls the objective, never the reverse)
  models/hf/checkpoint.py and models/hf/like.py import neither the other (launch/export_hf.py chooses)
  planning/           imports none of launch, benchmarks, experiments (the cost model: launch and benchmarks use it)
  launch/             imports nothing from benchmarks/ (measurements stay there; what launch needs is in planning)
  benchmarks/lib/     imports no benchmark script (the scripts use the helpers, never the reverse)
  experiments/        one way: experiments import the project, nothing in the project imports experiments
The house (`test_the_house_keeps_its_wings`, `test_no_import_circle`):
  runtime/ holds at most RUNTIME_TOP files at its top: data, post-training and checkpoints are wings
  (runtime/data/, runtime/posttrain/, runtime/checkpoint/) and no file at its top is named after one; the
  Hugging Face files are models/hf/, none at models/' top
  no import circle among the packages' modules
Tests (tests/):
  no test module imports another: shared fixtures live in tests/helpers/
  a test imports a benchmarks/ or experiments/ script only to test that script, through its public names: the
  script's name stands in the test file's name or docstring, or in the name or docstring of a function holding
  the import; helpers import no script
  code that only tests use lives with the tests: every benchmarks/lib module is imported outside tests/
  tests/unit/ forks nothing: no unit test imports multirank, or a helper that does (entry_point, doc_commands)
Each rule is tested on a planted violation in a temporary tree (`test_*_is_reported`).
"""

import ast
import os

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PACKAGES = ("models", "parallel", "optim", "runtime", "planning", "launch", "benchmarks", "experiments", "examples")
SCRIPTS = "benchmarks scripts"  # any benchmarks.X that is not under benchmarks.lib
EXPERIMENTS = "experiments"

# (modules the rule covers, forbidden module prefixes): a module is covered when its dotted name
# starts with the first entry (for "optim.*top": directly in optim/)
RULES = [
    ("models", ("parallel", "optim", "runtime", "planning", "launch", "benchmarks", EXPERIMENTS)),
    ("parallel", ("optim", "runtime", "planning", "launch", "benchmarks", EXPERIMENTS)),
    ("optim", ("runtime", "planning", "launch", "benchmarks", EXPERIMENTS)),
    ("optim.*top", ("optim.planner", "optim.sharded")),
    ("optim.planner", ("optim.sharded",)),
    ("runtime", ("planning", "launch", "benchmarks", EXPERIMENTS)),
    ("runtime.data", ("runtime.posttrain", "runtime.checkpoint", "runtime.train")),
    ("runtime.checkpoint", ("runtime.posttrain", "runtime.data", "runtime.train")),
    ("runtime.posttrain", ("runtime.train",)),
    ("models.hf.checkpoint", ("models.hf.like",)),
    ("models.hf.like", ("models.hf.checkpoint",)),
    ("planning", ("launch", "benchmarks", EXPERIMENTS)),
    ("launch", ("benchmarks", EXPERIMENTS)),
    ("benchmarks", (EXPERIMENTS,)),
    ("benchmarks.lib", (SCRIPTS,)),
    ("examples", (EXPERIMENTS,)),
]
RUNTIME_TOP = 22  # files at runtime/'s top
# a file at a package's top whose name starts with a key belongs in that wing
WINGS = {"runtime": {"data": "data", "posttrain": "posttrain", "rollout": "posttrain", "checkpoint": "checkpoint"},
         "models": {"hf": "hf", "int4": "hf"}}
FORKING = ("multirank",)  # tests/helpers/ modules that fork ranks; a helper importing one forks too


def _module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)[: -len(".py")]
    parts = rel.split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: str) -> bool:
    base = os.path.join(root, *name.split("."))
    return os.path.exists(base + ".py") or os.path.isdir(base)


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _import_names(node, root: str) -> list[tuple[str, list[str]]]:
    """[(module, names taken from it)] of one import node (`from pkg import sub` is pkg.sub when sub is a module)."""
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        subs = [(f"{node.module}.{a.name}", []) for a in node.names if _is_module(f"{node.module}.{a.name}", root)]
        plain = [a.name for a in node.names if not _is_module(f"{node.module}.{a.name}", root)]
        return [(node.module, plain)] + subs
    return []


def _file_imports(path: str, root: str) -> set[str]:
    """First-party modules `path` imports."""
    names = {m for node in ast.walk(_parse(path)) for m, _ in _import_names(node, root)}
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


def _is_script(name: str) -> bool:
    return name.startswith("benchmarks.") and not (name + ".").startswith("benchmarks.lib.")


def _forbidden(name: str, prefix: str) -> bool:
    if prefix == SCRIPTS:
        return _is_script(name)
    return name == prefix or name.startswith(prefix + ".")


def violations(root: str = REPO) -> list[str]:
    """'module -> imported (rule scope)' for every import that breaks a rule."""
    bad = []
    for module, names in sorted(imports(root).items()):
        for scope, prefixes in RULES:
            if _covered(module, scope):
                bad += [f"{module} -> {n} ({scope})" for n in sorted(names) if any(_forbidden(n, p) for p in prefixes)]
    return bad


def circles(root: str = REPO) -> list[tuple[str, ...]]:
    """Every set of modules that import each other in a loop (strongly connected components, Tarjan), sorted."""
    graph = imports(root)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def house_problems(root: str = REPO) -> list[str]:
    """Files at runtime/'s top beyond RUNTIME_TOP, and files at a package's top named after one of its wings."""
    problems = []
    top = sorted(f for f in os.listdir(os.path.join(root, "runtime")) if f.endswith(".py"))
    if len(top) > RUNTIME_TOP:
        problems.append(f"runtime/ has {len(top)} files at its top, more than {RUNTIME_TOP}")
    for package, wings in WINGS.items():
        for f in sorted(os.listdir(os.path.join(root, package))):
            wing = next((w for prefix, w in wings.items() if f.startswith(prefix)), None)
            if f.endswith(".py") and wing:
                problems.append(f"{package}/{f}: belongs in {package}/{wing}/")
    return problems


# ---- tests/ ---------------------------------------------------------------------------------------

def _test_files(tests_dir: str) -> list[str]:
    """Every .py under tests_dir, relative to it."""
    return sorted(os.path.relpath(os.path.join(d, name), tests_dir) for d, _, names in os.walk(tests_dir)
                  for name in names if name.endswith(".py"))


def _is_test(rel: str) -> bool:
    return os.path.basename(rel).startswith("test_")


def _test_modules_importing_tests(tests_dir: str) -> dict[str, list[str]]:
    """{test file: the test_* modules it imports}, read with `ast` like the rules above."""
    found = {}
    for f in filter(_is_test, _test_files(tests_dir)):
        tree = _parse(os.path.join(tests_dir, f))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module in (None, "tests")
                  for a in n.names}
        hits = sorted(n for n in names if n.split(".")[-1].startswith("test_"))
        if hits:
            found[f] = hits
    return found


def _imports_with_context(tree: ast.Module, filename: str):
    """(import node, the texts that may name its subject: the file's name and docstring, then the names and
    docstrings of the functions around the import)."""
    def walk(node, context):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, context + [child.name, ast.get_docstring(child) or ""])
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, context
            else:
                yield from walk(child, context)

    yield from walk(tree, [filename, ast.get_docstring(tree) or ""])


def script_imports(tests_dir: str, root: str = REPO) -> list[str]:
    """'file: module (why)' for each import of a benchmarks/ or experiments/ script from tests/ that is not a
    test of that script: its name absent from the docstrings and names around the import, a private name
    taken, or a helper importing a script at all."""
    bad = []
    for f in _test_files(tests_dir):
        for node, context in _imports_with_context(_parse(os.path.join(tests_dir, f)), os.path.basename(f)):
            for module, names in _import_names(node, root):
                if not (_is_script(module) or module.startswith(EXPERIMENTS + ".")):
                    continue
                stem = module.rsplit(".", 1)[-1]
                if not _is_test(f):
                    bad.append(f"{f}: {module} (a helper imports a script)")
                elif not any(stem in text for text in context):
                    bad.append(f"{f}: {module} (its test does not name {stem})")
                bad += [f"{f}: {module}.{n} (a private name)" for n in names if n.startswith("_")]
    return bad


def libs_only_tests_use(tests_dir: str, root: str = REPO) -> list[str]:
    """benchmarks/lib modules that tests import and nothing outside tests/ does (they belong in tests/helpers/)."""
    used = {n for names in imports(root).values() for n in names}
    from_tests = {m for f in _test_files(tests_dir) for node in ast.walk(_parse(os.path.join(tests_dir, f)))
                  for m, _ in _import_names(node, root) if m.startswith("benchmarks.lib.")}
    return sorted(from_tests - used)


def unit_tests_that_fork(tests_dir: str) -> list[str]:
    """Files of tests/unit/ that import a forking helper, directly or through another helper."""
    helpers = {os.path.basename(f)[:-3]: f for f in _test_files(tests_dir) if not _is_test(f)}

    def imported(rel):
        return {m.split(".")[0] for node in ast.walk(_parse(os.path.join(tests_dir, rel)))
                for m, _ in _import_names(node, tests_dir)}

    forking, grew = set(FORKING), True
    while grew:
        grew = False
        for name, rel in helpers.items():
            if name not in forking and imported(rel) & forking:
                forking.add(name)
                grew = True
    return [f for f in _test_files(tests_dir) if f.startswith("unit" + os.sep) and imported(f) & forking]


def test_imports_run_one_way():
    found = imports()
    # the scan sees the arrows that are allowed, so an empty violation list is not an empty scan
    assert "models.boxes" in found["models.hf.checkpoint"] and "models.boxes" in found["optim.planner.plan"]
    assert "optim.planner.plan" in found["optim.sharded.muon"] and "benchmarks.lib.harness" in found["benchmarks.optimizer_step"]
    assert "runtime.data.documents" in found["runtime.posttrain.rollout_batch"]
    assert "runtime.posttrain.objective" in found["experiments.teacher_tokens"]
    assert "planning.memory.pretrain" in found["launch.estimate_memory"]
    assert "planning.calibration.case" in found["benchmarks.calibrate"]
    assert len(found) > 150  # 166 modules when written
    assert violations() == []


def test_a_broken_arrow_is_reported(tmp_path):
    """A model module importing parallel/, a helper importing a script, a wing importing a higher one, the two
    export layouts importing each other, a benchmark importing an experiment, the planner importing a launch tool
    and a launch tool importing a benchmarks helper: each named, with its rule."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    for folder in ("benchmarks/lib", "optim/planner", "runtime/data", "runtime/posttrain", "models/hf"):
        (tmp_path / folder).mkdir()
    (tmp_path / "parallel" / "boxes.py").write_text("")
    (tmp_path / "benchmarks" / "gpu_check.py").write_text("")
    (tmp_path / "models" / "hf.py").write_text("def load():\n    from parallel.boxes import dtensor_box\n")
    (tmp_path / "benchmarks" / "lib" / "counters.py").write_text("from benchmarks import gpu_check\n")
    (tmp_path / "optim" / "planner" / "plan.py").write_text("import optim.sharded.muon\n")
    (tmp_path / "runtime" / "data" / "loader.py").write_text("from runtime.posttrain import rollouts\n")
    (tmp_path / "runtime" / "posttrain" / "rollouts.py").write_text("def f():\n    from runtime import train\n")
    (tmp_path / "runtime" / "train.py").write_text("")
    (tmp_path / "models" / "hf" / "checkpoint.py").write_text("def save():\n    from models.hf.like import write_like\n")
    (tmp_path / "models" / "hf" / "like.py").write_text("")
    (tmp_path / "experiments" / "tool_env.py").write_text("")
    (tmp_path / "benchmarks" / "teacher_tokens.py").write_text("from experiments.tool_env import GOALS\n")
    (tmp_path / "launch" / "estimate_memory.py").write_text("")
    (tmp_path / "planning" / "step.py").write_text("from launch import estimate_memory\n")
    (tmp_path / "launch" / "dry_run.py").write_text("from benchmarks.lib.counters import MATMULS\n")
    assert violations(str(tmp_path)) == [
        "benchmarks.lib.counters -> benchmarks.gpu_check (benchmarks.lib)",
        "benchmarks.teacher_tokens -> experiments.tool_env (benchmarks)",
        "launch.dry_run -> benchmarks.lib.counters (launch)",
        "models.hf -> parallel.boxes (models)",
        "models.hf.checkpoint -> models.hf.like (models.hf.checkpoint)",
        "optim.planner.plan -> optim.sharded.muon (optim.planner)",
        "planning.step -> launch (planning)",
        "planning.step -> launch.estimate_memory (planning)",
        "runtime.data.loader -> runtime.posttrain (runtime.data)",
        "runtime.data.loader -> runtime.posttrain.rollouts (runtime.data)",
        "runtime.posttrain.rollouts -> runtime.train (runtime.posttrain)",
    ]


def test_the_house_keeps_its_wings():
    assert house_problems() == []
    for wing in ("runtime/data", "runtime/posttrain", "runtime/checkpoint", "models/hf"):
        assert os.path.isfile(os.path.join(REPO, wing, "__init__.py")), wing


def test_a_crowded_runtime_and_a_file_outside_its_wing_are_reported(tmp_path):
    for package in WINGS:
        (tmp_path / package).mkdir()
    for i in range(RUNTIME_TOP):
        (tmp_path / "runtime" / f"part{i}.py").write_text("")
    (tmp_path / "runtime" / "data_config.py").write_text("")
    (tmp_path / "models" / "hf_like.py").write_text("")
    (tmp_path / "models" / "model.py").write_text("")
    assert house_problems(str(tmp_path)) == [
        f"runtime/ has {RUNTIME_TOP + 1} files at its top, more than {RUNTIME_TOP}",
        "runtime/data_config.py: belongs in runtime/data/",
        "models/hf_like.py: belongs in models/hf/",
    ]


def test_no_import_circle():
    assert circles() == []


def test_a_circle_is_reported(tmp_path):
    """hf.py and hf_like.py as they were: a lazy import inside a function closes the circle too."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "models" / "hf.py").write_text("def save():\n    from models.hf_like import write_like\n")
    (tmp_path / "models" / "hf_like.py").write_text("from models.hf import check_checkpoint\n")
    (tmp_path / "models" / "boxes.py").write_text("import models.model\n")
    (tmp_path / "models" / "model.py").write_text("")
    assert circles(str(tmp_path)) == [("models.hf", "models.hf_like")]


def test_no_test_module_imports_another():
    """Shared fixtures live in helper modules that are not test_*.py (tests/README.md)."""
    assert _test_modules_importing_tests(os.path.join(REPO, "tests")) == {}


def test_a_test_importing_a_test_is_reported(tmp_path):
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_a.py").write_text("from test_b import CASES\n")
    (tmp_path / "test_b.py").write_text("import parity_cases\nfrom tests import test_c\n")
    (tmp_path / "parity_cases.py").write_text("from test_a import x\n")  # helpers are not test modules
    assert _test_modules_importing_tests(str(tmp_path)) == {"test_b.py": ["test_c"],
                                                            os.path.join("unit", "test_a.py"): ["test_b"]}


def test_tests_import_a_script_only_to_test_it():
    tests_dir = os.path.join(REPO, "tests")
    assert script_imports(tests_dir) == []
    assert libs_only_tests_use(tests_dir) == []
    assert unit_tests_that_fork(tests_dir) == []
    # the scans see the imports that are allowed, so empty lists are not empty scans
    tree = _parse(os.path.join(tests_dir, "entry", "test_gpu_check.py"))
    assert any(m == "benchmarks.gpu_check" for node in ast.walk(tree) for m, _ in _import_names(node, REPO))
    assert len([f for f in _test_files(tests_dir) if f.startswith("unit" + os.sep)]) > 15


def test_a_test_using_a_script_for_something_else_is_reported(tmp_path):
    """A test taking a benchmark's private helper for another subject, a helper importing a script, a
    benchmarks/lib module only tests use, a unit test that forks through a helper: each reported."""
    root = tmp_path / "repo"
    for folder in ("benchmarks/lib", "experiments", "tests/unit", "tests/helpers", "runtime"):
        (root / folder).mkdir(parents=True)
    (root / "benchmarks" / "memory_validation.py").write_text("from benchmarks.lib import counters\n")
    (root / "benchmarks" / "lib" / "counters.py").write_text("")
    (root / "benchmarks" / "lib" / "ep_traffic.py").write_text("")
    (root / "experiments" / "tool_env.py").write_text("")
    tests = root / "tests"
    (tests / "unit" / "test_memory.py").write_text(
        '"""The memory estimate."""\nfrom benchmarks.memory_validation import _measure\n'
        "from benchmarks.lib.counters import count_step\n"
        "def test_env():\n    from experiments.tool_env import GOALS\n")
    (tests / "unit" / "test_tool_env.py").write_text(
        '"""The tool-use environment."""\nimport entry_point\nfrom benchmarks.lib.ep_traffic import split_by_node\n'
        "def test_benchmark_runs():\n"
        '    """benchmarks/memory_validation.py, small."""\n'
        "    from benchmarks.memory_validation import main\n"
        "    from experiments.tool_env import GOALS\n")
    (tests / "helpers" / "ep_cases.py").write_text("from benchmarks import memory_validation\n")
    (tests / "helpers" / "entry_point.py").write_text("from multirank import run_ranks\n")
    (tests / "helpers" / "multirank.py").write_text("")
    assert script_imports(str(tests), str(root)) == [
        os.path.join("helpers", "ep_cases.py") + ": benchmarks.memory_validation (a helper imports a script)",
        os.path.join("unit", "test_memory.py") + ": benchmarks.memory_validation (its test does not name "
        "memory_validation)",
        os.path.join("unit", "test_memory.py") + ": benchmarks.memory_validation._measure (a private name)",
        os.path.join("unit", "test_memory.py") + ": experiments.tool_env (its test does not name tool_env)",
    ]
    assert libs_only_tests_use(str(tests), str(root)) == ["benchmarks.lib.ep_traffic"]
    assert unit_tests_that_fork(str(tests)) == [os.path.join("unit", "test_tool_env.py")]
