"""Shared pieces of the benchmark scripts: the bench model, a timed masktrl run, phase timers,
tables and JSON.

Every timing here is wall-clock on whatever machine runs it. On a shared CPU the absolute
numbers drift from minute to minute, so each script alternates the things it compares within
one process and reports medians and ratios; read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import NoReturn

import torch

REPO = Path(__file__).resolve().parents[1]
# The warm-start cache (<OUT>/.cache/warmstart) is shared with `masktrl train --out outputs`.
OUT = Path(os.environ.get("MASKTRL_BENCH_OUT", REPO / "outputs"))
BENCH_TMP = OUT / "bench"  # run folders of timed runs; deleted after each run


# --------------------------------------------------------------------------- process memory


def rss_mib() -> float:
    """This process's resident memory now (MiB)."""
    import resource

    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def run_worker(script: str, variant: str, args, keys: tuple[str, ...]) -> dict:
    """Run ``script --worker VARIANT --key=value...`` (``args``' ``keys``) in a fresh process
    (its memory peak is its own) and return the JSON object it prints last."""
    import subprocess

    cmd = [sys.executable, script, "--worker", variant, *[f"--{k}={getattr(args, k)}" for k in keys]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (MiB; ``ru_maxrss`` is KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------- configs and models


def bench_config(*overrides: str):
    """The tiny preset (configs/tiny.yaml) with dotted overrides."""
    from masktrl.config import load_config

    return load_config(None, list(overrides))


def warm_model(cfg) -> Path:
    """Folder of the warm-started tiny model of ``cfg`` (built once, then read from the cache).

    The cache key is the one ``masktrl train`` uses, so a benchmark after a default training
    run (or the other way round) reuses the same warm start.
    """
    from masktrl.rl.warmstart import prepare_policy
    from masktrl.tasks import make_task

    _, _, info = prepare_policy(cfg, make_task(cfg.task, cfg.model), OUT)
    return Path(info["path"])


def copy_model(src: Path, dest: Path, **generation_overrides) -> Path:
    """A copy of a saved model folder (or the folder itself if ``dest`` is ``src``), with changed
    generation_config fields."""
    from transformers import GenerationConfig

    if Path(src).resolve() != Path(dest).resolve():
        shutil.copytree(src, dest, dirs_exist_ok=True)
    if generation_overrides:
        gc = GenerationConfig.from_pretrained(dest)
        for k, v in generation_overrides.items():
            setattr(gc, k, v)
        gc.save_pretrained(dest)
    return dest


def big_vocab_model(dest: Path, vocab: int, cfg, seed: int = 0) -> Path:
    """A randomly initialised tiny Qwen3 with a character tokenizer of about ``vocab`` tokens.

    The task alphabet comes first, then filler characters (CJK ideographs), so arithmetic
    prompts tokenize exactly as with the default tokenizer. Used where K must exceed the
    default vocabulary (17 tokens for plain arithmetic).
    """
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
    from masktrl.tasks import make_task

    alphabet = make_task(cfg.task, cfg.model).alphabet()
    filler = "".join(chr(0x4E00 + i) for i in range(max(0, vocab - 3 - len(alphabet))))
    tok = build_char_tokenizer(alphabet + filler)
    m = cfg.model
    model = build_tiny_model(
        tok, TinyModelConfig(m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size), seed
    )
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


# --------------------------------------------------------------------------- timed masktrl runs


class StepClock:
    """A stand-in for the rich progress object ``train.train`` reports to: one timestamp per RL step.

    ``train.train`` calls ``add_task("RL")`` right before its step loop and ``update`` at the end
    of every step (after metrics and any checkpoint), so consecutive marks bracket exactly
    one iteration of the real loop. ``on_step`` callbacks run at each mark.
    """

    def __init__(self):
        self.marks: list[float] = []
        self.cpu_marks: list[float] = []
        self.on_start: list = []
        self.on_step: list = []

    def add_task(self, name, *args, **kw):
        if name == "RL":
            for cb in self.on_start:
                cb()
            self.marks = [time.perf_counter()]
            self.cpu_marks = [time.process_time()]
        return name

    def update(self, task_id, *args, **kw):
        if task_id == "RL":
            self.marks.append(time.perf_counter())
            self.cpu_marks.append(time.process_time())
            for cb in self.on_step:
                cb()

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    def cpu_times(self) -> list[float]:
        """Process CPU time (all threads) per step: what waiting for a busy CPU does not inflate."""
        return [b - a for a, b in zip(self.cpu_marks, self.cpu_marks[1:])]


def run_masktrl(cfg, on_start=None, on_step=None) -> dict:
    """``masktrl.recipes.train.train`` on ``cfg`` in a scratch run folder (deleted afterwards).

    Returns per-step wall times (``step_times``, one per step of the real loop), per-step
    process CPU times (``cpu_times``), the metrics rows the run wrote and its summary.
    """
    from masktrl.recipes.train import train
    from masktrl.runs.plan import plan_config

    BENCH_TMP.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="run-", dir=BENCH_TMP))
    clock = StepClock()
    if on_start:
        clock.on_start.append(on_start)
    if on_step:
        clock.on_step.append(on_step)
    try:
        result = train(plan_config(cfg, root), progress=clock)
        rows = result.store.read_metrics()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    times = {"step_times": clock.step_times(), "cpu_times": clock.cpu_times()}
    return {**times, "metrics": rows, "summary": result.summary}


# --------------------------------------------------------------------------- phase timers


class PhaseTimer:
    """Exclusive wall time per named phase, by wrapping functions in place.

    ``wrap(owner, "attr", "phase")`` replaces ``owner.attr`` with a timed wrapper. A call's
    time goes to its phase minus the time of timed calls nested inside it, so the phases add
    up to the time spent inside any of them. ``absorb=True`` makes a phase keep the time of
    everything it calls (e.g. ``generate``, whose model forwards would otherwise count as
    policy forwards). ``restore()`` undoes every wrap.
    """

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.missing: list[str] = []
        self._stack: list[list] = []
        self._undo: list[tuple] = []

    def wrap(self, owner, attr: str, phase: str, absorb: bool = False) -> None:
        orig = getattr(owner, attr, None)
        if orig is None:
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            return
        own = attr in owner.__dict__ if isinstance(owner, type) else True  # else: inherited, undo = delattr
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
        if isinstance(raw, (staticmethod, classmethod)):
            raise TypeError(f"cannot time {attr}: static/class methods are not supported")
        stack, totals = self._stack, self.totals

        @functools.wraps(orig)
        def timed(*args, **kw):
            if stack and stack[-1][2]:
                return orig(*args, **kw)
            frame = [phase, 0.0, absorb]
            stack.append(frame)
            t0 = time.perf_counter()
            try:
                return orig(*args, **kw)
            finally:
                dt = time.perf_counter() - t0
                stack.pop()
                totals[phase] += dt - frame[1]
                if stack:
                    stack[-1][1] += dt

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, orig if own else None))

    def take(self) -> dict[str, float]:
        """The totals since the last ``take`` (and reset them)."""
        out = dict(self.totals)
        self.totals.clear()
        return out

    def restore(self) -> None:
        for owner, attr, orig in reversed(self._undo):
            if orig is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)
        self._undo.clear()


def wrap_common_phases(timer: PhaseTimer) -> None:
    """Stages both trainers share: transformers ``generate``, backward, optimizer."""
    import transformers.generation.utils as gen_utils

    timer.wrap(gen_utils.GenerationMixin, "generate", "rollout: transformers generate", absorb=True)
    timer.wrap(torch.Tensor, "backward", "backward")
    timer.wrap(torch.nn.utils, "clip_grad_norm_", "optimizer")
    timer.wrap(torch.optim.AdamW, "step", "optimizer")
    timer.wrap(torch.optim.Optimizer, "zero_grad", "optimizer")
    timer.wrap(torch.optim.lr_scheduler.LRScheduler, "step", "optimizer")


def wrap_masktrl_phases(timer: PhaseTimer, common: bool = True) -> None:
    """Time every stage of masktrl's RL step (see ``PHASE_GROUPS``)."""
    from transformers.models.qwen3 import modeling_qwen3

    from masktrl.methods.registry import Method
    from masktrl.recipes import train
    from masktrl.rl import policy, update
    from masktrl.rl import train_state as checkpoint
    from masktrl.rollout import hf
    from masktrl.rollout.hf import HFEngine
    from masktrl.runs.store import RunStore

    if common:
        wrap_common_phases(timer)
    timer.wrap(train, "collect_rollouts", "rollout: prompts, decode, score, advantages")
    timer.wrap(HFEngine, "generate", "rollout: logprob/top-K extraction")
    timer.wrap(hf, "shared_prefill", "rollout: shared prompt prefill", absorb=True)
    # the engine's own loops (rollout.decode: auto / fused, rollout.drop_finished), instead of generate
    timer.wrap(hf, "decode_fixed_batch", "rollout: masktrl decode loop", absorb=True)
    timer.wrap(hf, "decode_dropping_finished", "rollout: masktrl decode loop", absorb=True)
    timer.wrap(update, "policy_token_batch", "logprobs: batch assembly")
    timer.wrap(modeling_qwen3.Qwen3Model, "forward", "logprobs: policy forward")
    timer.wrap(policy, "token_logprobs_and_entropy", "logprobs: token_logprobs (sampled + top-K) + entropy")
    timer.wrap(Method, "token_losses", "loss")
    timer.wrap(Method, "aggregate", "loss")
    timer.wrap(update, "token_diagnostics", "diagnostics")
    timer.wrap(train, "policy_update", "update glue (minibatch split, .item(), means)")
    timer.wrap(RunStore, "write_rollouts", "io: rollout parquet")
    timer.wrap(RunStore, "mark_done", "io: manifest")
    timer.wrap(RunStore, "set_info", "io: manifest")
    timer.wrap(RunStore, "append_metrics", "io: metrics line")
    timer.wrap(checkpoint, "save_step", "io: checkpoint", absorb=True)


def wrap_trl_phases(timer: PhaseTimer, trainer_cls, common: bool = True) -> None:
    """Time the same stages inside TRL's GRPOTrainer."""
    from transformers import Trainer

    if common:
        wrap_common_phases(timer)
    timer.wrap(trainer_cls, "_generate_and_score_completions", "rollout: prompts, decode, score, advantages")
    timer.wrap(trainer_cls, "_compute_loss", "loss")
    timer.wrap(trainer_cls, "_get_per_token_logps_and_entropies", "logprobs: policy forward + logprobs", absorb=True)
    timer.wrap(Trainer, "_maybe_log_save_evaluate", "io: logging")


PHASE_GROUPS = {
    "rollout": "rollout:",
    "logprobs": "logprobs:",
    "loss": "loss",
    "backward": "backward",
    "optimizer": "optimizer",
    "diagnostics": "diagnostics",
    "io": "io:",
}


def group_phases(phases: dict[str, float], total: float) -> dict[str, float]:
    """Phases summed into ``PHASE_GROUPS``; ``other`` = everything else, untimed glue included."""
    out = {g: 0.0 for g in PHASE_GROUPS}
    for name, t in phases.items():
        group = next((g for g, prefix in PHASE_GROUPS.items() if name.startswith(prefix)), None)
        if group:
            out[group] += t
    out["other"] = total - sum(out.values())
    return out


# --------------------------------------------------------------------------- statistics and output


def median(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def machine() -> dict:
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        pass
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if Console().is_terminal else Console(width=200)  # no wrapping into a file or pipe
    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*[_fmt(x) for x in r])
    console.print(table)


def _fmt(x) -> str:
    if isinstance(x, float):
        if x != x:
            return "—"
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def write_json(path: str | None, obj: dict) -> None:
    if not path:
        return
    from masktrl.io import atomic_write_text

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # a benchmark killed while writing leaves the previous JSON whole
    atomic_write_text(Path(path), json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    print(f"wrote {path}")


def finish(script: str, argv, load_start: float, json_path: str | None, **fields) -> dict:
    """A benchmark's result: its command line, ``fields``, the load when it started and the
    machine (whose ``loadavg_1m`` is the load at the end); written to ``json_path`` when given."""
    command = " ".join(["python", f"benchmarks/{script}", *(argv if argv is not None else sys.argv[1:])])
    result = {"command": command, **fields, "loadavg_1m_start": load_start, "machine": machine()}
    write_json(json_path, result)
    return result


class Parser(argparse.ArgumentParser):
    """argparse's parser whose every refusal is one line (``script.py: error: ...``) and exit
    code 2, not argparse's usage block before it (``--help`` still prints the usage)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def count(text: str) -> int:
    """An argparse type for a count that must be at least 1 (threads, rounds, repetitions, steps):
    anything else is refused in one line, exit 2."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def parser(description: str) -> argparse.ArgumentParser:
    p = Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--threads", type=count, default=1, help="torch CPU threads (masktrl's train.threads default)")
    return p


def quiet() -> None:
    """Silence the libraries' progress bars and warnings, so tables stay readable."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from masktrl.models.loading import quiet_transformers

    quiet_transformers()


def die(msg: str) -> NoReturn:
    print(msg, file=sys.stderr)
    raise SystemExit(2)
