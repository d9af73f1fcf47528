"""The EP refusal table (parallel/ep/refusals.py) against the docs; the parallel package's structure: no
method swapping, no import circle, private torch names only in parallel/_torch_private.py."""

import ast
import pathlib
import re

import pytest

from parallel.ep.refusals import REFUSALS, docs_rows

ROOT = pathlib.Path(__file__).resolve().parent.parent
PARALLEL = ROOT / "parallel"


def test_docs_table_is_the_refusal_table():
    text = (ROOT / "docs" / "expert_parallel.md").read_text()
    section = text.split("## Refused combinations", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows == docs_rows()
    assert len(rows) == len(REFUSALS)


def test_no_method_swapping_in_parallel():
    hits = [p.name for p in PARALLEL.rglob("*.py") if "MethodType" in p.read_text()]
    assert hits == []


def _imports(path: pathlib.Path) -> set[str]:
    """parallel.* modules `path` imports (at any depth: a lazy import is still an edge)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("parallel"):
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("parallel")}
    return out


def test_parallel_imports_have_no_circle():
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PARALLEL.rglob("*.py")}
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    state = {}

    def visit(m, path):
        if state.get(m) == "open":
            pytest.fail(f"import circle: {' -> '.join(path + [m])}")
        if state.get(m) is None:
            state[m] = "open"
            for n in sorted(graph[m]):
                visit(n, path + [m])
            state[m] = "done"

    for m in sorted(graph):
        visit(m, [])


def test_private_torch_names_only_in_the_private_module():
    """`torch._x`, `from torch..._x import`, and FSDP2's `_get_fsdp_state` / `_training_state` / `_pre_backward`."""
    pattern = re.compile(r"torch\._[a-z]|from torch[\w.]* import _|_get_fsdp_state|_training_state|_pre_backward"
                         r"|_execution_engine|_plugins|\._base\b")
    hits = [f"{p.name}:{i}" for p in PARALLEL.rglob("*.py") if p.name != "_torch_private.py"
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(re.sub(r"_torch_private\.\w+", "", line.split("#")[0]))]
    assert hits == []


def test_fsdp_probe_refuses_in_one_line_naming_the_torch_version():
    """A unit without FSDP2's state stands for a torch whose internals moved: the knob is refused."""
    import torch
    from torch import nn

    from parallel._torch_private import check_fsdp_unit_states

    check_fsdp_unit_states("ep_recompute_ahead")  # this torch: the states and methods are there
    with pytest.raises(ValueError) as error:
        check_fsdp_unit_states("ep_recompute_ahead", nn.Linear(2, 2))
    message = str(error.value)
    assert message.startswith(f"parallel.ep_recompute_ahead: FSDP2 internals it relies on differ in torch "
                              f"{torch.__version__}") and "\n" not in message
