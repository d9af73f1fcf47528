"""The EP refusal table (parallel/ep/refusals.py) against the docs; the parallel package's structure: no
method swapping in parallel/ or models/ (a planted one is caught), no import circle, private torch names
only in parallel/_torch_private.py."""

import ast
import pathlib
import re

import pytest

from parallel.ep.refusals import REFUSALS, docs_rows

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARALLEL = ROOT / "parallel"


def test_docs_table_is_the_refusal_table():
    text = (ROOT / "docs" / "expert_parallel.md").read_text()
    section = text.split("## Refused combinations", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows == docs_rows()
    assert len(rows) == len(REFUSALS)


SWAP = re.compile(r"\.forward\s*=(?!=)|MethodType|setattr\([^)]*[\"']forward[\"']")  # a forward replaced on a live module


def _swaps(*folders: pathlib.Path) -> list[str]:
    """`file:line` of every method swap in the Python files under `folders` (comments included: a swap
    explained in a comment is still a swap someone will copy)."""
    return [f"{p.relative_to(folder.parent)}:{i}" for folder in folders for p in sorted(folder.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if SWAP.search(line)]


def test_no_method_swapping_in_parallel_or_models():
    """Compiled and checkpointed regions go through the `region` slot (models/region.py), the EP dispatch
    through `dispatcher`, context parallelism through `kv_source` and `sdpa`: no forward is replaced."""
    assert _swaps(PARALLEL, ROOT / "models") == []


@pytest.mark.parametrize("line", ["    module.forward = torch.compile(module.forward)", "block.forward=wrapped",
                                  "m.forward = types.MethodType(f, m)", "setattr(module, 'forward', f)"])
def test_the_swap_guard_catches_a_planted_swap(tmp_path, line):
    planted = tmp_path / "pkg" / "sub"
    planted.mkdir(parents=True)
    (planted / "ok.py").write_text("if module.forward == other:\n    pass\n")
    (planted / "bad.py").write_text(f"def wrap(module):\n{line}\n")
    assert _swaps(tmp_path / "pkg") == ["pkg/sub/bad.py:2"]


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
    """`torch._x`, `from torch..._x import`, and FSDP2's internal state (`_get_fsdp_state`, `_training_state`, ...)."""
    pattern = re.compile(r"torch\._[a-z]|from torch[\w.]* import _|_get_fsdp_state|_training_state|_pre_backward"
                         r"|_execution_engine|_plugins|\._base\b")
    hits = [f"{p.name}:{i}" for p in PARALLEL.rglob("*.py") if p.name != "_torch_private.py"
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(re.sub(r"_torch_private\.\w+", "", line.split("#")[0]))]
    assert hits == []



@pytest.mark.parametrize("key", ["ep_interleave", "ep_pair_micro_batches", "ep_recompute_ahead"])
def test_a_removed_ep_knob_fails_in_one_line_naming_it_with_exit_2(tmp_path, monkeypatch, capsys, key):
    """In a config file or on the command line, before any process group: the key, "removed", what instead."""
    from launch.pretrain import main
    from parallel.ep.config import REMOVED_EP_KNOBS

    monkeypatch.setenv("WORLD_SIZE", "1")
    config = tmp_path / "old.toml"
    config.write_text(f"[parallel]\nep = 1\n{key} = true\n")
    for argv in (["--config", str(config)], [f"--parallel.{key}=true"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"config error: parallel.{key}: {REMOVED_EP_KNOBS[key]}" and "removed" in err
