"""``masktrl sweep --launcher slurm``: each method x seed run as its own SLURM job.

The sweep's plan (``recipes/sweep.py``) decides what each run needs, with the usual resume
rules: a complete run is skipped, an interrupted one resumes in place (``train --resume``), one
that cannot resume starts again as ``<method>-seed<k>-retry<i>``. ``train_command`` turns each
planned run into the ``masktrl train`` command line that does exactly that (``--print-commands``
prints them); ``write_script`` wraps one in an sbatch script (``#SBATCH`` lines from
``--slurm KEY=VALUE``, optionally under ``accelerate launch --config_file``), and ``submit``
hands it to ``sbatch``.

Submitted jobs are recorded in ``<out>/.sweep/slurm/jobs.json`` (run folder -> job id). A later
sweep over the same folder asks ``squeue`` which of them are still pending or running and
leaves those runs alone (their trainer may be on another node, where the manifest's pid means
nothing here), so re-running the sweep after some jobs finished or died submits exactly the runs
that still need it. Without ``squeue`` on the PATH a recorded job is taken as still active
(``--resubmit`` submits again anyway).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from masktrl.config import split_method
from masktrl.errors import ConfigError, MasktrlError
from masktrl.io import atomic_write_json, atomic_write_text
from masktrl.readers import read_json

JOBS_FILE = "jobs.json"
ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "PREEMPTED"}


def slurm_dir(out: Path) -> Path:
    return Path(out) / ".sweep" / "slurm"


def train_command(
    item,
    *,
    out: Path,
    config: Path | list | None,
    overrides: list[str],
    accelerate_config: Path | None = None,
    python: str | None = None,
) -> list[str]:
    """The ``masktrl train`` argv that carries out planned run ``item`` (a ``SweepRun``): a new
    run, a fresh retry folder, or ``--resume`` of an interrupted one; under ``accelerate launch
    --config_file`` when ``accelerate_config`` is given."""
    python = python or sys.executable
    base = [python, "-m", "masktrl.cli", "train"]
    if accelerate_config is not None:
        base = [python, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config), *base[1:]]
    if item.state == "resume":
        return [*base, "--resume", str(item.root), "--out", str(out)]
    if item.state not in ("new", "retry"):
        raise ValueError(f"run {item.name} is {item.state}: nothing to start")
    name, params = split_method(item.method)  # a method spec: NAME[:KEY=VALUE...]
    argv = [*base, "--method", name, "--seed", str(item.seed)]
    for path in (
        [] if config is None else config if isinstance(config, (list, tuple)) else [config]
    ):  # --config is repeatable
        argv += ["--config", str(path)]
    for o in [*overrides, *params]:
        argv += ["--set", o]
    return [*argv, "--out", str(out), "--run", item.root.name]


def parse_options(pairs: list[str]) -> list[str]:
    """``--slurm KEY=VALUE`` (or a bare ``KEY`` flag) as ``#SBATCH --KEY=VALUE`` arguments."""
    out = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().lstrip("-")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", key):
            raise ConfigError(f"--slurm {pair!r}: expected KEY=VALUE, e.g. --slurm partition=gpu --slurm gres=gpu:8")
        if key in ("output", "error", "job-name", "J", "o", "e"):
            raise ConfigError(
                f"--slurm {key}: set by masktrl (job name masktrl-<run>, log <out>/.sweep/slurm/<run>-<jobid>.log)"
            )
        if any(
            ord(c) < 32 or ord(c) == 127 for c in value
        ):  # a line break ends the #SBATCH line: the rest ran as a command
            raise ConfigError(
                f"--slurm {pair!r}: the value holds a control character (a line break would end the "
                "#SBATCH line and run the rest in the job script)"
            )
        if sep and (why := _not_one_word(value)):  # sbatch splits an #SBATCH line into arguments
            raise ConfigError(
                f"--slurm {pair!r}: this value {why}, so it would not reach --{key} as written in the job's "
                "#SBATCH line"
            )
        out.append(f"--{key}={value}" if sep else f"--{key}")
    return out


def _not_one_word(value: str) -> str | None:
    """Why ``value`` would not reach its option whole as sbatch reads an ``#SBATCH`` line (a blank
    outside quotes ends an argument, an unescaped ``#`` outside quotes starts a comment, a quote
    left open stops sbatch; a backslash escapes the next character), else None."""
    quote, escaped = None, False
    for c in value:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c == "#":
            return "has a # outside quotes (sbatch reads the rest of the line as a comment)"
        elif c.isspace():
            return "has a blank outside quotes (quote it for sbatch: --slurm 'comment=\"a b\"')"
    return "leaves a quote open" if quote else None


def write_script(item, argv: list[str], out: Path, options: list[str], *, workdir: Path | None = None) -> Path:
    """Write ``<out>/.sweep/slurm/<run>.sbatch`` that runs ``argv`` (``train_command``) from
    ``workdir`` (default: the current folder, so relative paths mean what they meant here)."""
    folder = slurm_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    name = item.root.name
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={_sbatch_word(f'masktrl-{name}')}",
        # sbatch expands %j, %x ... in the log's path: a % of the folder or run name is %%
        f"#SBATCH --output={_sbatch_word(str((folder / name).resolve()).replace('%', '%%') + '-%j.log')}",
        *(f"#SBATCH {opt}" for opt in options),
        "# written by masktrl sweep --launcher slurm; run it again with: sbatch "
        + shlex.quote(str(folder / f"{name}.sbatch")),
        "set -euo pipefail",
        f"cd {shlex.quote(str(Path(workdir or os.getcwd()).resolve()))}",
        "exec " + shlex.join(argv),
        "",
    ]
    path = folder / f"{name}.sbatch"
    atomic_write_text(path, "\n".join(lines))
    path.chmod(0o755)
    return path


def _sbatch_word(text: str) -> str:
    """``text`` as one argument of an ``#SBATCH`` line: sbatch splits the line at whitespace and
    reads quotes and backslashes, so a value with them is double-quoted, its ``"`` and ``\\``
    escaped (a space in --out or a run name cut the log's path at the space)."""
    if re.fullmatch(r"[\w@%+=:,./-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def check_sbatch() -> str:
    """The sbatch executable, or a ``ConfigError`` before anything is written."""
    exe = shutil.which("sbatch")
    if exe is None:
        raise ConfigError(
            "--launcher slurm: sbatch is not on the PATH (run on a SLURM login node, or pass "
            "--no-submit to only write the scripts)"
        )
    return exe


def submit_job(script: Path) -> str:
    """``sbatch --parsable SCRIPT``; returns the job id."""
    r = subprocess.run([check_sbatch(), "--parsable", str(script)], capture_output=True, text=True)
    if r.returncode != 0:
        raise MasktrlError(
            f"sbatch {script} failed: {(r.stderr.strip().splitlines() or ['exit ' + str(r.returncode)])[-1]}"
        )
    job = r.stdout.strip().split(";")[0]  # --parsable: "jobid" or "jobid;cluster"
    if not job:
        raise MasktrlError(f"sbatch {script}: no job id in its output")
    return job


def recorded_jobs(out: Path) -> dict[str, str]:
    """Run folder name -> job id of the jobs earlier sweeps submitted."""
    path = slurm_dir(out) / JOBS_FILE
    if not path.is_file():
        return {}
    try:
        return {
            str(k): str(v) for k, v in read_json(path, error=MasktrlError).items()
        }  # bounded: depth, non-finite numbers
    except (MasktrlError, AttributeError):
        raise MasktrlError(
            f"{path}: unreadable (corrupted); delete it once no job of this sweep is queued or running"
        ) from None


def record_job(out: Path, run: str, job: str) -> None:
    jobs = recorded_jobs(out)
    jobs[run] = job
    atomic_write_json(slurm_dir(out) / JOBS_FILE, jobs)


def active_jobs(jobs: dict[str, str]) -> dict[str, str]:
    """The recorded jobs still pending or running (run -> 'job <id> <STATE>'), from ``squeue``; all
    of them when squeue is not available (unknown counts as active: never two writers)."""
    if not jobs:
        return {}
    exe = shutil.which("squeue")
    if exe is None:
        return {run: f"job {job} (squeue not available to check it)" for run, job in jobs.items()}
    r = subprocess.run(
        [exe, "-h", "-o", "%i %T", "-j", ",".join(sorted(set(jobs.values())))], capture_output=True, text=True
    )
    states = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return {run: f"job {job} {states[job]}" for run, job in jobs.items() if states.get(job) in ACTIVE_STATES}


@dataclass(frozen=True)
class SlurmOptions:
    """The sweep's slurm flags."""

    options: tuple[str, ...] = ()  # --slurm KEY=VALUE
    submit: bool = True  # False: --no-submit (write the scripts only)
    resubmit: bool = False  # --resubmit


def launch(
    items,
    out: Path,
    config,
    overrides: list[str],
    accelerate_config: Path | None,
    *,
    print_only: bool,
    slurm: SlurmOptions = SlurmOptions(),
):
    """``--print-commands`` (each run's train command) or ``--launcher slurm`` (one sbatch job per
    run still to do: skipped when complete, still queued or running, or trained right now);
    yields the lines to show."""
    todo = [i for i in items if i.state != "complete"]
    commands = {
        i.root: train_command(i, out=out, config=config, overrides=overrides, accelerate_config=accelerate_config)
        for i in todo
    }
    if print_only:
        for item in items:
            yield f"# {item.root.name}: complete" if item.state == "complete" else shlex.join(commands[item.root])
        return
    sbatch_options, submit = parse_options(list(slurm.options)), slurm.submit
    if submit and todo:
        check_sbatch()
    active = {} if slurm.resubmit else active_jobs(recorded_jobs(out))
    yield f"masktrl sweep --launcher slurm: {len(items) - len(todo)} complete, {len(todo)} to run, under {out}"
    for item in items:
        name = item.root.name
        if item.state == "complete":
            yield f"skip {name} (complete)"
        elif name in active:
            yield f"skip {name}: {active[name]} (still queued or running; left alone)"
        elif item.writer is not None:
            who = f"pid {item.writer}" if item.writer > 0 else "another process"
            yield f"skip {name}: being trained right now by {who} (it holds the run's lock; left alone)"
        else:
            script = write_script(item, commands[item.root], out, sbatch_options)
            if not submit:
                yield f"wrote {script}"
                continue
            job = submit_job(script)
            record_job(out, name, job)
            note = {"resume": ", resuming", "retry": ", fresh restart"}.get(item.state, "")
            yield f"submitted {name} as job {job}{note} ({script})"
    if todo:
        yield (
            "run this command again when the jobs are done: complete runs are skipped, and the "
            "compare table "
            "is printed once every run is complete"
        )
