"""Every ``masktrl …`` command written in README.md and docs/*.md names a real subcommand and
only options that subcommand has, so the docs cannot drift from the CLI unnoticed; and the ones
that run on the tiny default in seconds are run, and must exit 0.

Commands are taken from fenced code blocks (``bash``/``sh``/unlabelled) and from inline code
spans; ``accelerate launch … -m masktrl.cli train …`` counts as ``masktrl train …``.

Run (``RUN``): in a folder whose ``outputs/`` holds tiny finished runs under the names the docs
use (copies of the session's ``analysis_runs``), each command as written; a ``train`` of the
800-step default with ``--dry-run`` added (every check, seconds; a real one takes minutes).
Every other command matches a reason it is not run (``NOT_RUN``), so a new command in the docs
is either run or given its reason."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import typer.main

from masktrl.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
INLINE = re.compile(r"(?<!`)`(masktrl [^`\n]+)`(?!`)")
# `masktrl …` at the start of a shell line, after `&&`/`;`/`VAR=value`, or `-m masktrl.cli …`
ENTRY = re.compile(r"(?:^(?:\w+=\S+\s+)*|(?:&&|;)\s*)masktrl\s+(.*)$|-m masktrl\.cli\s+(.*)$")


def _commands_in(text: str) -> list[str]:
    found = []
    for lang, body in FENCE.findall(text):
        if lang not in ("", "bash", "sh", "console", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip().lstrip("$ ")
            m = ENTRY.search(line)
            if m and not line.startswith("#"):
                found.append(m.group(1) or m.group(2))
    found += [m[len("masktrl ") :] for m in INLINE.findall(text)]
    return found


def _cases():
    for doc in DOCS:
        for cmd in _commands_in(doc.read_text()):
            yield pytest.param(cmd, id=f"{doc.name}: masktrl {cmd}"[:120])


def _tokens(cmd: str) -> list[str]:
    cmd = re.split(r"\s(?:&&|\|\||\||;|>|2>)\s", f" {cmd} ")[0]
    try:
        return shlex.split(cmd)
    except ValueError:  # an unbalanced quote inside prose: split on spaces
        return cmd.split()


def _is_group(cmd) -> bool:
    return hasattr(cmd, "get_command")


def _context(cmd):
    return cmd.context_class(cmd)


def _options(cmd) -> set[str]:
    names = {"--help"}
    for p in cmd.get_params(_context(cmd)):
        names.update(getattr(p, "opts", []))
        names.update(getattr(p, "secondary_opts", []))
    return names


CASES = list(_cases())
CLI = typer.main.get_command(app)


def test_the_docs_hold_commands():
    assert len(CASES) > 50  # the extraction itself works


@pytest.mark.parametrize("cmd", CASES)
def test_documented_command_uses_only_real_subcommands_and_options(cmd):
    group = CLI
    words = _tokens(cmd)
    node, rest = group, list(words)
    while _is_group(node) and rest and node.get_command(_context(node), rest[0]) is not None:
        node = node.get_command(_context(node), rest.pop(0))
    if _is_group(node):
        # `masktrl --help`, or a placeholder such as `masktrl <command>` in prose
        if not rest or rest[0].startswith("-") or rest[0].startswith("<") or rest[0] in ("…", "..."):
            return
        pytest.fail(f"masktrl {cmd!r}: no subcommand {rest[0]!r} (have {', '.join(sorted(node.commands))})")
    known = _options(node)
    for word in rest:
        if word.startswith("--") and len(word) > 2:
            name = word.split("=", 1)[0]
            if name.endswith("…") or name.endswith("..."):
                continue
            assert name in known, (
                f"masktrl {cmd!r}: {name} is not an option of this command ({', '.join(sorted(known))})"
            )


# --------------------------------------------------------------------------- the commands run

DRY = "dry"  # a train of the 800-step default: run with --dry-run added
RUN = [  # (the command as the docs write it, how it runs), in order: a later one may read what an earlier one wrote
    ("config keys", None),
    ("config show", None),
    ("train --run r1 --dry-run", None),
    ("train --method sis --seed 1", DRY),
    ("train --method dppo --set method.divergence=topk-tv --set train.lr=1e-4", DRY),
    ("train --set method.kl_coef=0.01 --set method.entropy_coef=1e-3 --set method.adv_norm=rloo", DRY),
    ("train --set model.lora.rank=8", DRY),
    (
        "train --set model.lora.rank=16 --set model.lora.alpha=32 --set "
        "model.lora.target_modules=q_proj,k_proj,v_proj,o_proj",
        DRY,
    ),
    ("train --config configs/tiny.yaml --set train.steps=20", DRY),
    ("train --set warmstart.steps=50 --set train.steps=3", DRY),
    ("train --run def --set train.steps=6 --set train.checkpoint_every=1", DRY),
    ("runs --out outputs", None),
    ("eval task --model outputs/grpo-run --k 16", None),
    ("eval synthetic --model outputs/my-run --step 0 --k 4", None),
    ("rollout --model grpo-run --data synthetic --n 8 --logprobs-k 20 --prompts 320 --output batch.parquet", None),
    ("train --method dppo --rollouts-from batch.parquet --set train.steps=5", DRY),
    ("analyze dynamics outputs/grpo-seed0 outputs/grpo-seed1 outputs/sis-seed0 outputs/sis-seed1", None),
    ("analyze compare outputs/grpo-seed0 outputs/grpo-seed1 outputs/sis-seed0 outputs/sis-seed1 --baseline grpo", None),
    ("analyze sis --run outputs/sis-seed0 --bias", None),
    ("eval task --model outputs/sweep1 --k 8", None),
    ("analyze compare outputs/sweep1 --eval task --test paired", None),
    ("check-method sapo", None),
    ("check-method examples/tanh_clip.py:tanh_clip", None),
    ("check-method examples/tanh_clip.py:tanh_clip --set method.eps_high=0.5", None),
    ("config keys --method examples/tanh_clip.py:tanh_clip", None),
]
NOT_RUN = [  # (pattern on "DOC: command", why it is not run), first match
    (
        r"(\b(RUN|BENCH|NAME|RUN_OR_FILE|M|S|T|DIR)\b|<|\.\.\.|…|\$|\[|\{)",
        "a template: placeholders stand for the reader's own values",
    ),
    (r": (eval|evaluate|rollout|runs|train|sweep|check-method|analyze \w+)$", "the command's name in prose"),
    (r": (eval|rollout|train) --(top-p|rollouts-from|model RUN|data dataset|output)$", "an option named in prose"),
    (
        r"^RELIABILITY\.md: ",
        "a probe of docs/RELIABILITY.md (most end in a refusal by design): run by the test its section names",
    ),
    (r"^(NOTEBOOK_)?BENCHMARKS\.md: ", "a benchmark of full runs (minutes each)"),
    (r"configs/(lab|qwen3)", "the lab or Qwen3 presets: minutes to days per run (docs/LAB.md, docs/CLUSTER.md)"),
    (r": sweep ", "a sweep trains several full runs (minutes each)"),
    (r"tanh_clip-seed0", "compares the runs of the sweep before it in the docs (minutes each)"),
    (
        r"--steps 101:|--run lab0|--run lab-k50|--run long0|outputs/mismatch/|outputs/lab-sweep",
        "reads the lab's runs (docs/LAB.md), not made here",
    ),
    (
        r"--data data/|task\.source=data/|--model (Qwen/|/ckpt/)|: eval " r"(aime|aime24|gsm8k|math500) ",
        "needs a dataset file or a model that is not shipped",
    ),
    (r": eval dataset ", "needs a run trained on a dataset"),
    (r"--resume grpo-20261130|outputs/grpo-20250101", "names a run of the example's own"),
    (
        r": train --method pdm --rollouts-from grpo-run$",
        "replays the README's own grpo-run (64 prompts a step); the tiny runs here have 8",
    ),
    (
        r": analyze estimators --run (outputs/run1|def) .*--k 5,10,20,50",
        "--k 50 re-cuts lists of K >= 50 (the lab's rollout.logprobs_k=50 run); the tiny runs store K = 5",
    ),
    (
        r": analyze estimators --run def|: analyze disagreement --run outputs/run1",
        "replays steps of a longer run (minutes on the tiny one)",
    ),
    (r": train( |$)", "trains the default's 800 steps (minutes); its options are checked above"),
]


def reason_not_run(case: str) -> str | None:
    """Why the documented command ``case`` ("DOC: masktrl CMD") is not run, or None."""
    doc, cmd = case.split(": masktrl ", 1)
    if cmd in dict(RUN):
        return None
    for pattern, why in NOT_RUN:
        if re.search(pattern, f"{doc}: {cmd}"):
            return why
    return "unclassified"


def not_run() -> dict[str, list[str]]:
    """The documented commands not run, by reason (``python -m tests.test_docs_commands`` prints them)."""
    out: dict[str, list[str]] = {}
    for c in CASES:
        doc = c.id.split(": masktrl ")[0]
        why = reason_not_run(f"{doc}: masktrl {c.values[0]}")
        if why is not None:
            out.setdefault(why, []).append(f"{doc}: masktrl {c.values[0]}")
    return out


def test_every_documented_command_is_run_or_has_a_reason():
    documented = {c.values[0] for c in CASES}
    assert {cmd for cmd, _ in RUN} <= documented, "a RUN entry the docs no longer hold"
    unclassified = [
        c.id for c in CASES if reason_not_run(f"{c.id.split(': masktrl ')[0]}: masktrl {c.values[0]}") == "unclassified"
    ]
    assert not unclassified, unclassified


DOCUMENTED_RUNS = {
    "grpo-seed0": "grpo-seed0",
    "grpo-seed1": "grpo-seed1",
    "sis-seed0": "sis-seed0",
    "sis-seed1": "sis-seed1",
    "grpo-run": "grpo-seed0",
    "run1": "grpo-seed0",
    "my-run": "grpo-seed0",
}


@pytest.fixture(scope="module")
def docs_folder(analysis_runs, tmp_path_factory):
    """A current folder whose outputs/ holds the runs the docs name (copies of the session's tiny
    finished runs) and a sweep's folder ``outputs/sweep1``."""
    work = tmp_path_factory.mktemp("docs")
    for name, source in DOCUMENTED_RUNS.items():
        shutil.copytree(analysis_runs / source, work / "outputs" / name)
    for name in ("grpo-seed0", "grpo-seed1", "sis-seed0", "sis-seed1"):
        shutil.copytree(analysis_runs / name, work / "outputs" / "sweep1" / name)
    shutil.copytree(
        analysis_runs / ".cache" / "warmstart", work / "outputs" / ".cache" / "warmstart"
    )  # step 0: the warm starts
    shutil.copytree(
        ROOT / "configs", work / "configs"
    )  # --config configs/...: the docs' commands run from the repository
    shutil.copytree(ROOT / "examples", work / "examples")  # --method examples/...: a rule from a file
    return work


@pytest.mark.parametrize("cmd, how", RUN, ids=[f"masktrl {c}"[:100] for c, _ in RUN])
def test_documented_command_runs(cmd, how, docs_folder, monkeypatch):
    from tests.conftest import cli

    monkeypatch.chdir(docs_folder)
    args = shlex.split(cmd) + (["--dry-run"] if how == DRY else [])
    result = cli(*args, ok=False)
    assert result.exit_code == 0, (cmd, result.output[-3000:], result.exception)


if __name__ == "__main__":
    for why, cmds in not_run().items():
        print(f"{why} ({len(cmds)}):")
        print("".join(f"    {c}\n" for c in cmds))
