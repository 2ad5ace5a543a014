"""``masktrl sweep``: a grid of methods x seeds, one training run after another.

Run names are ``<method>-seed<k>`` under one output folder (a method spec with parameters,
``pdm:tail=uniform``, is named ``pdm-tail-uniform-seed<k>``), so every run of a seed reuses the
same cached warm start (``<out>/.cache/warmstart``). The sweep resumes at run granularity:

* a run that is **complete** (summary.json present and manifest status ``complete``) with
  the same resolved config is skipped;
* a complete run with a *different* config stops the sweep before anything runs (choose
  another ``--out``; nothing is overwritten);
* an **incomplete** run (interrupted or failed: no summary, or status not ``complete``) with
  the same config is reported and **resumed** in place (from its last checkpoint, reusing its
  stored rollouts);
* an incomplete run that cannot be resumed (no manifest, run.yaml missing or changed) is
  reported and left as it is; the run starts again in a fresh folder
  ``<method>-seed<k>-retry<i>`` (stored artifacts are never deleted).

Every config is built and validated before the first run starts. The fates are decided by
``runs/plan.py`` (``sweep_fate``), and each run enters training the way ``masktrl train`` does:
its plan, carried out by ``recipes.train.train`` (``runs/session.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from masktrl.config import MAX_SEED, Config, diff_configs, load_config, split_method
from masktrl.errors import ConfigError, MasktrlError
from masktrl.method_spec import is_rule_file
from masktrl.runs.plan import plan_config, sweep_fate
from masktrl.runs.store import check_run_name


@dataclass
class SweepRun:
    method: str  # the method spec: NAME or NAME:KEY=VALUE[:KEY=VALUE...]
    seed: int
    name: str  # the canonical name <method>-seed<k>
    cfg: Config
    root: Path  # the folder that holds (or will hold) the complete run
    state: str  # "complete" (skip) | "new" | "resume" (incomplete, resumable) | "retry" (fresh folder)
    incomplete: list[Path] = field(default_factory=list)
    writer: int | None = (
        None  # plan(busy_ok=True): the pid holding the run's lock (-1: not known), if a process trains it now
    )


def parse_methods(text: str) -> list[str]:
    """Comma-separated method specs: ``NAME`` or ``NAME:KEY=VALUE[:KEY=VALUE...]`` (a method with
    its parameters, e.g. ``pdm:tail=uniform``, ``dppo:divergence=binary-tv``), so one sweep can hold
    two variants of a method. Each spec's parameters are checked when its config is built."""
    from masktrl.method_spec import is_rule_file, load_rule
    from masktrl.methods import method_names

    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise ConfigError("--methods is empty")
    for spec in methods:
        name, params = split_method(spec)
        if is_rule_file(name):
            load_rule(name)  # a missing file, a name not in it, a broken rule: one line before anything is planned
        elif name not in method_names():
            raise ConfigError(
                f"unknown method {name!r}; valid methods: {', '.join(method_names())}, or path/to/rules.py:name"
            )
    if len(set(methods)) != len(methods):
        raise ConfigError(f"--methods lists a method twice: {text}")
    return methods


def run_stem(spec: str) -> str:
    """The run-name stem of a method spec: ``pdm:tail=uniform`` -> ``pdm-tail-uniform``,
    ``grpo:correction.kind=icepop`` -> ``grpo-correction-kind-icepop``, ``rules/soft.py:soft`` -> ``soft``."""
    name, overrides = split_method(spec)
    if is_rule_file(name):  # examples/soft_clip.py:soft_clip -> soft_clip
        name = name.rpartition(":")[2]
    keys = [
        f"{key.removeprefix('method.').replace('.', '-')}-{_stem_value(value)}"
        for key, _, value in (o.partition("=") for o in overrides)
    ]
    return "-".join([name, *keys])


def _stem_value(value: str) -> str:
    """A parameter's value in a run name; a file's rule (``correction.kind=path/to/corr.py:clamp``)
    by its file's name and rule (``corr.py:clamp``): a run name is one folder, with no path separator."""
    if is_rule_file(value):
        return PurePosixPath(value.replace("\\", "/")).name
    return value


MAX_SWEEP_SEEDS = 1000
"""The most seeds one sweep takes (a count beyond it is a typo, and would be planned run by run)."""


def parse_seeds(text: str) -> list[int]:
    """``3`` -> seeds 0, 1, 2; ``0,4,7`` -> exactly those seeds. At most ``MAX_SWEEP_SEEDS``
    seeds, each in [0, MAX_SEED]: ConfigError otherwise, before anything is planned."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
        else:
            count = int(text)
            if count > MAX_SWEEP_SEEDS:
                raise ConfigError(f"--seeds {text.strip()[:40]}: at most {MAX_SWEEP_SEEDS} seeds")
            if count < 1:  # it said "must give distinct non-negative seeds, got '0'"
                raise ConfigError(f"--seeds {text.strip()[:40]}: a count of seeds must be >= 1")
            seeds = list(range(count))
    except ValueError:
        raise ConfigError(f"--seeds must be a count (3) or a list (0,4,7), got {text[:60]!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds must give distinct non-negative seeds, got {text[:60]!r}")
    if len(seeds) > MAX_SWEEP_SEEDS:
        raise ConfigError(f"--seeds: {len(seeds)} seeds, at most {MAX_SWEEP_SEEDS}")
    high = [s for s in seeds if s > MAX_SEED]
    if high:
        raise ConfigError(f"--seeds: seed {high[0]} is out of range [0, {MAX_SEED}]")
    return seeds


def check_flags(
    methods: list[str], overrides: list[str], baseline: str | None, launcher: str, *, no_submit: bool, resubmit: bool
) -> None:
    """ConfigError, before the first run, for flags that cannot mean what they say: a seed or a
    method name set with ``--set`` (every run takes its seed from ``--seeds``, its method from
    ``--methods``), a ``--baseline`` that is not
    swept, slurm's ``--no-submit`` / ``--resubmit`` with another launcher."""
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "seed":
            raise ConfigError(
                f"--set {item} conflicts with --seeds (every run of a sweep takes its seed from --seeds): drop one"
            )
        if key.strip() in ("method", "method.name"):
            raise ConfigError(
                f"--set {item} conflicts with --methods (every run of a sweep takes its method from "
                "--methods): drop one"
            )
    if baseline is not None and not baseline.strip():
        raise ConfigError(f"--baseline is empty: give one of the swept methods ({', '.join(methods)})")
    if baseline is not None and baseline not in methods and baseline not in {split_method(m)[0] for m in methods}:
        raise ConfigError(f"--baseline {baseline} is not among the swept methods ({', '.join(methods)})")
    for flag, given in (("--no-submit", no_submit), ("--resubmit", resubmit)):
        if given and launcher != "slurm":
            raise ConfigError(f"{flag} goes with --launcher slurm (the local launcher submits nothing)")


def plan(
    out: Path,
    methods: list[str],
    seeds: list[int],
    config: Path | list[Path] | None = None,
    overrides: list[str] = (),
    *,
    busy_ok: bool = False,
) -> list[SweepRun]:
    """Every run of the grid with its config (``config``: one preset or several, composed as
    ``load_config`` does) and its fate among its folders (``runs/plan.py: sweep_fate``). A run
    that a process is training right now stops the plan with one line, or, with ``busy_ok`` (the
    slurm launcher: its job may be that process), is planned as a resume with ``writer`` set."""
    if Path(out).exists() and not Path(out).is_dir():  # --print-commands printed commands that would all fail
        raise MasktrlError(f"--out {out}: a file, not a folder (the sweep's runs are folders under it)")
    runs = []
    first: dict[str, Config] = {}  # method spec -> its config for the first seed
    named: dict[str, str] = {}  # run name -> the method spec that makes it
    for method in methods:
        for seed in seeds:
            name_, params = split_method(method)
            cfg = load_config(config, [*overrides, *params], method=name_, seed=seed)
            if seed == seeds[0]:
                _check_distinct(method, cfg, first)
            name = _check_name(method, f"{run_stem(method)}-seed{seed}", named)
            fate = sweep_fate(Path(out), name, cfg, busy_ok=busy_ok)
            _check_name(method, fate.root.name, {})  # a retry folder's name too
            runs.append(SweepRun(method, seed, name, cfg, fate.root, fate.state, fate.incomplete, fate.writer))
    return runs


def _check_name(method: str, name: str, named: dict[str, str]) -> str:
    """``name``, the run name spec ``method`` makes, if ``masktrl train --run`` takes it and no
    other spec of the grid makes it too (two rule files' rules of one name: the second run found
    the first one's folder mid-sweep, and ``--print-commands`` printed one command twice)."""
    try:
        check_run_name(name)
    except ConfigError as exc:
        raise ConfigError(f"--methods: {method!r} makes an {exc}; rename the rule or its file") from None
    if name in named:
        raise ConfigError(
            f"--methods: {named[name]!r} and {method!r} both make the run name {name!r} (one folder for two "
            "configs): sweep them into two --out folders, or give one rule another name"
        )
    named[name] = method
    return name


def _check_distinct(method: str, cfg: Config, seen: dict[str, Config]) -> None:
    """Refuse a method spec that trains the same config as an earlier one (a parameter set to
    its default value, e.g. ``dppo`` and ``dppo:divergence=topk-kl``): the compare table would
    hold one method twice under two names."""
    for other, other_cfg in seen.items():
        if other_cfg.resolved_method() == cfg.resolved_method() and not diff_configs(
            other_cfg, cfg, ignore=("method.",)
        ):
            raise ConfigError(
                f"--methods: {method!r} trains the same config as {other!r} (its parameters are the defaults); drop one"
            )
    seen[method] = cfg


def check_launcher(launcher: str, accelerate_config: Path | None, print_commands: bool) -> None:
    """ConfigError for a launcher this sweep cannot use."""
    if launcher not in ("local", "slurm"):
        raise ConfigError(f"--launcher must be local or slurm, got {launcher!r}")
    if accelerate_config is not None and not accelerate_config.is_file():
        raise ConfigError(f"--accelerate-config {accelerate_config}: no such file")
    if accelerate_config is not None:  # every job would fail at its launch, on the cluster, hours later
        from masktrl.readers import read_yaml

        settings = read_yaml(accelerate_config)  # one line for broken YAML, naming the line
        if not isinstance(settings, dict):
            what = "an empty file" if settings is None else f"a YAML {type(settings).__name__}"
            raise ConfigError(
                f"--accelerate-config {accelerate_config}: not an accelerate config ({what}, not a mapping of settings)"
            )
    if accelerate_config is not None and launcher == "local" and not print_commands:
        raise ConfigError(
            "--accelerate-config goes with --launcher slurm or --print-commands (the local launcher "
            "trains in this process)"
        )


def run_one(item: SweepRun, progress=None) -> Path:
    """Train one planned run into ``item.root`` (a complete run is returned as it is): its plan
    (``runs/plan.py: plan_config``) through the one way into training (``recipes.train.train``)."""
    from masktrl.recipes.train import train

    if item.state != "complete":
        train(plan_config(item.cfg, item.root, resume=item.state == "resume"), progress)
        item.state = "complete"
    return item.root


def run(
    runs: list[SweepRun],
    progress_bar: Callable[[], AbstractContextManager] | None = None,
    on_event: Callable[[str, SweepRun], None] | None = None,
) -> list[Path]:
    """Train every run that is not complete, in order, each under a fresh ``progress_bar()``;
    ``on_event`` hears ``skip`` or ``start`` before each run. Returns the folders of all runs."""
    done = []
    for item in runs:
        if on_event:
            on_event("skip" if item.state == "complete" else "start", item)
        bar = progress_bar() if progress_bar is not None and item.state != "complete" else contextlib.nullcontext()
        with bar as progress:
            done.append(run_one(item, progress))
    return done
