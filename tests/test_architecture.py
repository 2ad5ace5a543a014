"""The import direction of docs/DESIGN.md, enforced: `lint-imports` checks the contracts of
pyproject.toml ([tool.importlinter]) and fails on any import against the layers."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_imports_point_one_way():
    lint = Path(sys.executable).with_name("lint-imports")
    assert lint.is_file(), "lint-imports is missing: pip install -e '.[dev]' (import-linter)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [str(lint), "--no-cache", "--no-logo"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout and "Contracts: 5 kept" in r.stdout, r.stdout[-2000:]


def _functions(folder: str):
    """(``path:line name``, lines, parameters) of every function under ``masktrl/<folder>/``;
    ``self`` and ``cls`` are not counted, ``*args`` and ``**kwargs`` are."""
    import ast

    for path in sorted((REPO / "masktrl" / folder).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [
                    x.arg for x in (a.vararg, a.kwarg) if x
                ]
                params = len([n for n in names if n not in ("self", "cls")])
                yield f"{path.relative_to(REPO).as_posix()} {node.name}", node.end_lineno - node.lineno + 1, params


MAX_LINES, MAX_PARAMS = 60, 8


def test_functions_fit_on_a_screen():
    """No function in recipes/, runs/ or rl/ is longer than 60 lines (docs/DESIGN.md)."""
    long = [
        f"{name} ({n} lines)"
        for folder in ("recipes", "runs", "rl")
        for name, n, _ in _functions(folder)
        if n > MAX_LINES
    ]
    assert not long, long


def test_functions_take_at_most_eight_parameters():
    """No function in recipes/, runs/ or rl/ takes more than 8 parameters: more travel together as
    one object (a settings dataclass, the run's ``State``, a bound method)."""
    many = [
        f"{name} ({n} parameters)"
        for folder in ("recipes", "runs", "rl")
        for name, _, n in _functions(folder)
        if n > MAX_PARAMS
    ]
    assert not many, many


def test_the_train_recipe_is_setup_the_loop_the_step_and_evaluation():
    """recipes/train.py holds setup, the loop, the RL step and evaluation (at most 450 lines) with
    one way in, ``train(plan)``; the run's lifecycle is runs/session.py's, the folder's fate
    runs/plan.py's (the sweep has no planner of its own)."""
    import ast

    text = (REPO / "masktrl" / "recipes" / "train.py").read_text()
    assert len(text.splitlines()) <= 450
    tree = ast.parse(text)
    public = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    assert "train" in public and "run" not in public
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert [a.arg for a in train.args.args][:1] == ["plan"]
    sweep = (REPO / "masktrl" / "recipes" / "sweep.py").read_text()
    for planner in ("def run_state", "def _resumable", "def _next_retry", "RunStore(", "locks."):
        assert planner not in sweep, planner


def test_commands_are_thin():
    """No command module is longer than 120 lines: a command parses, calls one stage, prints."""
    long = [
        f"{p.relative_to(REPO)} ({n} lines)"
        for p in sorted((REPO / "masktrl" / "commands").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 120
    ]
    assert not long, long


STAGE_LITERAL = re.compile(r"^(eval/(before|after)|step/|checkpoint/|warmstart$|lora-base$|summary$|config$)")
STORE_CALLS = {"mark_done", "is_done", "stage", "verify"}  # RunStore's methods that take a stage key


def _stage_key_uses(path: Path) -> list[str]:
    """Where ``path`` parses a key (``split("/")``, ``rsplit("/")``, ``partition("/")``) or
    spells a stage key: a string that starts like one (``eval/before``, ``step/``,
    ``checkpoint/``...), or any literal given to a store method that takes a stage key."""
    import ast

    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func, args = node.func, node.args
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        literal = (
            args[0].value if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str) else None
        )
        if name in ("split", "rsplit", "partition", "rpartition") and literal == "/":
            hits.append(f'{path.relative_to(REPO)}:{node.lineno} {name}("/")')
        elif name in STORE_CALLS and literal is not None:
            hits.append(f"{path.relative_to(REPO)}:{node.lineno} {name}({literal!r})")
        for arg in args:
            if (
                isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
                and "/" in arg.value
                and STAGE_LITERAL.match(arg.value)
            ):
                hits.append(f"{path.relative_to(REPO)}:{node.lineno} {arg.value!r}")
    return hits


def test_stage_keys_are_parsed_and_spelled_only_by_the_run_store():
    """Stage keys are formatted and parsed in runs/store.py only (``rollout_key``, ``eval_steps``,
    ``EVAL_BEFORE_KEY``...): no ``split("/")`` / ``rsplit("/")`` elsewhere, no stage key spelled
    as a literal."""
    hits = [hit for p in sorted((REPO / "masktrl").rglob("*.py")) if p.name != "store.py" for hit in _stage_key_uses(p)]
    assert not hits, hits


def test_the_stage_key_rule_catches_what_it_names(tmp_path):
    bad = REPO / "masktrl" / "_stage_probe.py"
    try:
        bad.write_text('k = "eval/x/000001"\nk.rsplit("/", 1)\nstore.is_done("warmstart")\nget("eval/before")\n')
        hits = _stage_key_uses(bad)
    finally:
        bad.unlink()
    assert len(hits) == 3, hits


def _module_graph() -> dict[str, set[str]]:
    """masktrl module -> the masktrl modules it imports, at the top or inside a function. A
    package importing its own submodules (to register their commands) is left out."""
    import ast

    names = {}
    for path in (REPO / "masktrl").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for mod, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("masktrl"):
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module for a in node.names
                }
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("masktrl")}
        graph[mod] = {
            d for d in deps if d in names and d != mod and not (path.name == "__init__.py" and d.startswith(mod + "."))
        }
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    """No two modules import each other, not even through an import inside a function (which
    only hides the circle): what both need lives in a module below them both."""
    assert not _cycles(_module_graph()), _cycles(_module_graph())


def test_the_circle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
