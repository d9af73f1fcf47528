"""The docs stay true: every command in README.md, tests/README.md and docs/**.md names a file that exists, every
`--flag` given to a launch/, benchmarks/ or experiments/ script is one its `--help` lists, every repository path in
backticks exists, and every relative link (and its #anchor) resolves. Every repository path named in a
docstring of the code or the tests exists.

Commands are read from code blocks and from inline code that starts with `python` or `torchrun`; the
helps come from one subprocess that calls each script's `main(["--help"])` (one torch import, ~4 s)."""

import ast
import glob
import json
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOP = ("benchmarks", "configs", "docs", "examples", "experiments", "launch", "models", "optim", "parallel",
       "planning", "runtime",
       "tests")
FILE_EXT = (".py", ".toml", ".md", ".json", ".jsonl", ".png")
CHECKED_FLAGS = ("launch/", "benchmarks/", "experiments/")
PYTEST_VALUED = ("-p", "-m", "-k", "-c", "-o")  # pytest options whose value is the next word


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def doc_files() -> list[str]:
    """README.md, tests/README.md and every docs/**.md, relative to the repository root."""
    docs = glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)
    return ["README.md", os.path.join("tests", "README.md")] + sorted(os.path.relpath(p, REPO) for p in docs)


def _split_code(text: str) -> tuple[list[str], list[str], str]:
    """(fenced block bodies, inline code spans, the prose with both blanked out)."""
    blocks = re.findall(r"^\s*```[^\n]*\n(.*?)^\s*```", text, flags=re.DOTALL | re.MULTILINE)
    prose = re.sub(r"^\s*```[^\n]*\n.*?^\s*```", "", text, flags=re.DOTALL | re.MULTILINE)
    spans = re.findall(r"`([^`\n]+)`", prose)
    return blocks, spans, re.sub(r"`[^`\n]+`", "", prose)


def command_lines(text: str) -> list[str]:
    """Shell commands: lines of code blocks (continuations joined) and inline spans starting with python/torchrun,
    split at `&&`, `;`, `|`, `$(`."""
    blocks, spans, _ = _split_code(text)
    lines = [ln for b in blocks for ln in re.sub(r"\\\n\s*", " ", b).splitlines()]
    lines += [s for s in spans if re.match(r"(python|torchrun)\s", s)]
    parts = [p.strip() for ln in lines for p in re.split(r"&&|;|\||\$\(", ln)]
    return [p for p in parts if p and not p.startswith("#")]


def _words(command: str) -> list[str]:
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        words = command.split()
    return [w.strip("[]()") for w in words]


def parse_command(command: str):
    """(script or module path, flags given to it), or None when the line runs no python/torchrun.

    Leading `VAR=value`, `timeout N`, `nice -n N`, `srun` are skipped; under `torchrun` (or launch/torchrun.py)
    the script is the first `.py` word and torchrun's own flags are not checked. `python -m pytest X` gives
    the test paths X (before any `::`); `python -m pkg.mod` the module's file."""
    words = _words(command)
    while words and (re.match(r"\w+=", words[0]) or words[0] in ("srun", "nice", "timeout", "-n")
                     or words[0].isdigit()):
        words = words[1:]
    if not words or words[0] not in ("python", "python3", "torchrun"):
        return None
    if words[0].startswith("python") and len(words) > 2 and words[1] == "-m":
        if words[2] == "pytest":  # its paths: neither an option nor the value of one (`-p no:cacheprovider`)
            args = words[3:]
            return [w.split("::")[0] for i, w in enumerate(args)
                    if not w.startswith("-") and (i == 0 or args[i - 1] not in PYTEST_VALUED)], []
        return [words[2].replace(".", "/") + ".py"], []
    rest = words[1:]
    if words[0] == "torchrun" or (rest and rest[0] == "launch/torchrun.py"):
        rest = rest[1:] if rest and rest[0] == "launch/torchrun.py" else rest
        while rest and not rest[0].endswith(".py"):
            rest = rest[1:]
    if not rest or not rest[0].endswith(".py"):
        return None
    flags = [w.split("=")[0] for w in rest[1:] if w.startswith("--")]
    return [rest[0]], [f for alt in flags for f in alt.split("|")]


@lru_cache(maxsize=1)
def _helps() -> dict:
    """script -> the text its main(["--help"]) prints, or None where it prints nothing: every launch/ and
    benchmarks/ script with a `main`, in one subprocess, once per test session."""
    scripts = [os.path.relpath(p, REPO) for folder in CHECKED_FLAGS
               for p in sorted(glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True))
               if "\ndef main(" in _read(p)]
    code = """
import contextlib, importlib, io, json, sys
out = {}
for path in sys.argv[1:]:
    buf = io.StringIO()
    try:
        module = importlib.import_module(path[:-3].replace("/", "."))
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            module.main(["--help"])
        error = None
    except SystemExit:
        error = None
    except Exception as e:
        error = repr(e)[:300]
    out[path] = buf.getvalue() or None
    out[path + " error"] = error
print(json.dumps(out))
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    result = subprocess.run([sys.executable, "-c", code, *scripts], capture_output=True, text=True,
                            cwd=REPO, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def help_flags(script: str):
    """The set of `--flags` the script's --help names (None: it has no --help); a help that says it takes
    `--section.key=value` config overrides adds the keys launch/pretrain.py's --help lists."""
    text = _helps().get(script)
    if text is None:
        return None
    flags = set(re.findall(r"--[A-Za-z0-9][\w.\-]*", text)) | {"--help"}
    if "--section.key=value" in text and script != "launch/pretrain.py":
        flags |= help_flags("launch/pretrain.py")
    return flags


def _exists(path: str, root: str) -> bool:
    """A path, a glob (`*`) or a brace pattern (`{a,b}`): every expansion matches something."""
    m = re.search(r"\{([^{}]*)\}", path)
    if m:
        return all(_exists(path[:m.start()] + alt + path[m.end():], root) for alt in m.group(1).split(","))
    return bool(glob.glob(os.path.join(root, path))) if "*" in path else os.path.exists(os.path.join(root, path))


def repo_paths(text: str) -> list[str]:
    """Repository files named in code (inline or in blocks): a top-level folder of the repo, then a name with
    one of FILE_EXT; placeholders (`<...>`, `N`) are left out."""
    blocks, spans, _ = _split_code(text)
    found = []
    for chunk in blocks + spans:
        for word in re.findall(r"[\w.{},*/\-]+", chunk):
            word = word.split("::")[0].rstrip(".,")
            if word.split("/")[0] in TOP and "/" in word and word.endswith(FILE_EXT):
                found.append(word)
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    _, _, prose = _split_code(text)
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.DOTALL | re.MULTILINE),
                              flags=re.MULTILINE):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out | set(re.findall(r'<a (?:id|name)="([^"]+)"', prose))


def link_problems(doc: str, text: str, root: str = REPO) -> list[str]:
    """Relative links of `doc` (a path under root) whose file or #anchor does not exist."""
    _, _, prose = _split_code(text)
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(root, os.path.dirname(doc), path)) if path else os.path.join(root, doc)
        if not os.path.exists(full):
            problems.append(f"{doc}: link {target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in anchors(_read(full)):
            problems.append(f"{doc}: link {target}: no heading #{anchor}")
    return problems


def reference_problems(doc: str, text: str, root: str = REPO) -> list[str]:
    """Commands naming missing files or flags their script's --help does not list, and missing repo paths."""
    problems, uses, named = [], [], set()
    for line in command_lines(text):
        parsed = parse_command(line)
        if parsed is None:
            continue
        paths, flags = parsed
        named.update(paths)
        for path in paths:
            if not _exists(path, root):
                problems.append(f"{doc}: `{line}`: no file {path}")
            elif flags and path.startswith(CHECKED_FLAGS):
                uses.append((path, flags, line))
    for path, flags, line in uses:
        known = help_flags(path)
        if known is None:
            why = _helps().get(path + " error") or "no output"
            problems.append(f"{doc}: `{line}`: {path} --help prints nothing ({why}), so its flags cannot be checked")
            continue
        problems += [f"{doc}: `{line}`: {path} --help does not list {f}" for f in flags if f not in known]
    problems += [f"{doc}: no file {p}" for p in repo_paths(text) if p not in named and not _exists(p, root)]
    return problems


def _named_paths(text: str) -> list[str]:
    """Repository files a text names: a top-level folder of the repo, then a name with one of FILE_EXT;
    placeholders (`<...>`, an all-capital name such as `launch/X.py` or `CASE.toml`) are left out."""
    found = []
    for word in re.findall(r"[\w.{},*/\-]+", text):
        word = word.split("::")[0].rstrip(".,")
        stem = os.path.splitext(os.path.basename(word))[0]
        if word.split("/")[0] in TOP and "/" in word and word.endswith(FILE_EXT) and not re.fullmatch(r"[A-Z_]+", stem):
            found.append(word)
    return found


def docstring_problems(root: str = REPO) -> list[str]:
    """'file:line: no file PATH' for every repository path named in a docstring (module, class or function) of
    a .py file under root's code and test folders that does not exist."""
    problems = []
    for top in TOP:
        for path in sorted(glob.glob(os.path.join(root, top, "**", "*.py"), recursive=True)):
            tree = ast.parse(_read(path), path)
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                doc = ast.get_docstring(node, clean=False)
                line = node.body[0].lineno if doc else 0
                problems += [f"{os.path.relpath(path, root)}:{line}: no file {p}" for p in _named_paths(doc or "")
                             if not _exists(p, root)]
    return problems


def test_every_command_flag_path_and_link_in_the_docs_exists():
    problems = []
    for doc in doc_files():
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            text = f.read()
        problems += reference_problems(doc, text) + link_problems(doc, text)
    assert problems == [], "\n".join(problems)


def test_every_path_named_in_a_docstring_exists():
    assert docstring_problems() == []


def test_a_docstring_naming_a_missing_file_is_reported(tmp_path):
    """A moved file named by its old path fails, wherever the docstring is; a placeholder and a glob do not."""
    (tmp_path / "runtime" / "data").mkdir(parents=True)
    (tmp_path / "runtime" / "data" / "loader.py").write_text('''"""Reads runtime/data/loader.py's sources."""\n''')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        '''"""Tests of runtime/data/*.py and launch/X.py."""\n\n\nclass Case:\n    """As in runtime/data.py."""\n\n\n'''
        '''def test_y():\n    """See benchmarks/counters.py."""\n''')
    assert docstring_problems(str(tmp_path)) == [
        os.path.join("tests", "test_x.py") + ":5: no file runtime/data.py",
        os.path.join("tests", "test_x.py") + ":9: no file benchmarks/counters.py",
    ]


def test_the_benchmarks_reference_lists_every_script_with_flags_its_help_lists():
    """docs/benchmarks.md has a table row per benchmarks/ and experiments/ script with a `main` (a bare name is
    under benchmarks/); its flags column names only flags of that script's --help (a script without --help,
    host_syncs.py, is exempt)."""
    with open(os.path.join(REPO, "docs", "benchmarks.md"), encoding="utf-8") as f:
        rows = [line.split(" | ") for line in f if re.match(r"\| `(experiments/)?\w+\.py`", line)]
    problems, listed = [], set()
    for cells in rows:
        name = re.match(r"\| `((experiments/)?\w+\.py)`", cells[0]).group(1)
        script = name if "/" in name else "benchmarks/" + name
        listed.add(script)
        known = help_flags(script)
        flags = re.findall(r"--[A-Za-z0-9][\w.\-]*", cells[2].replace("\\|", " "))
        problems += [f"{script}: {flag}" for flag in flags if known is not None and flag not in known]
    scripts = {s for s in _helps() if s.startswith(("benchmarks/", "experiments/")) and s.endswith(".py")}
    assert problems == [] and sorted(scripts - listed) == [], (problems, sorted(scripts - listed))


def test_the_readme_is_a_landing_page_that_reaches_every_doc():
    """<= 200 lines, and every docs/ page is linked from the README or from a page the README links."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 200
    reached, todo = set(), ["README.md"]
    while todo:
        doc = todo.pop()
        reached.add(doc)
        _, _, prose = _split_code(_read(os.path.join(REPO, doc)))
        for target in re.findall(r"\]\(([^)#\s]+\.md)", prose):
            path = os.path.relpath(os.path.normpath(os.path.join(REPO, os.path.dirname(doc), target)), REPO)
            if path not in reached and os.path.exists(os.path.join(REPO, path)):
                todo.append(path)
    assert sorted(set(doc_files()) - reached) == []


def test_the_check_fails_on_each_kind_of_broken_reference(tmp_path):
    """A page with one broken reference of each kind: each is reported, and the good ones are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A section\n")
    for script in ("launch/pretrain.py", "benchmarks/projection.py"):
        os.makedirs(tmp_path / os.path.dirname(script), exist_ok=True)
        (tmp_path / script).write_text("")
    page = """# Page
```bash
python launch/pretrain.py --training.steps=5 --training.stepz=5
python launch/no_such_script.py
torchrun --nproc_per_node 2 benchmarks/projection.py --worlds 256 [--no-such-flag]
python -m pytest tests/test_missing.py -q
```
Run `python benchmarks/projection.py --json out.json`, read `optim/no_such_module.py`.
[good](other.md#a-section), [missing page](missing.md), [missing heading](other.md#no-such-section)
"""
    problems = reference_problems("docs/page.md", page, root=str(tmp_path)) + \
        link_problems("docs/page.md", page, root=str(tmp_path))
    text = "\n".join(problems)
    for expected in ("does not list --training.stepz", "no file launch/no_such_script.py", "does not list --no-such-flag",
                     "no file tests/test_missing.py", "no file optim/no_such_module.py", "link missing.md: no such file",
                     "link other.md#no-such-section: no heading"):
        assert expected in text, text
    assert len(problems) == 7, text


def test_commands_are_parsed_as_a_shell_would_split_them():
    assert parse_command("OMP_NUM_THREADS=1 nice -n 19 python benchmarks/x.py --a 1 [--b=2]") == \
        (["benchmarks/x.py"], ["--a", "--b"])
    assert parse_command("python launch/torchrun.py --nproc_per_node 8 launch/pretrain.py --config c.toml") == \
        (["launch/pretrain.py"], ["--config"])
    assert parse_command("python -m pytest tests/test_a.py::test_b -q") == (["tests/test_a.py"], [])
    assert parse_command("python -m pytest -q -p no:cacheprovider -m inductor tests/") == (["tests/"], [])
    assert parse_command("echo $?") is None
    assert slug("Projection: Kimi K2 on 64..4096 GPUs") == "projection-kimi-k2-on-644096-gpus"
    assert slug("What stands between K2 and 35% (projected)") == "what-stands-between-k2-and-35-projected"
