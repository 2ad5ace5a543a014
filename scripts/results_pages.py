"""The generated parts of README.md and docs/*.md: every one made from committed data by this script.

    python scripts/results_pages.py            # check: exit 1 naming every block or figure that differs
    python scripts/results_pages.py --write    # rewrite them from the data

Two kinds of generated text, both between marker comments:

- a **block**, ``<!-- generated: NAME -->`` ... ``<!-- /generated -->`` on lines of their own: a
  table (or a few lines) that ``BLOCKS[NAME]`` renders from its data file;
- a **figure**, ``<!-- fig: NAME -->VALUE<!-- /fig -->`` inline in prose: one number that
  ``figures()`` renders from the same data, so a page that quotes a figure quotes it as generated.

A marker written inside a code span (right after a backtick) is an example in prose, not a marker.

The rules (``problems`` returns every breach; tests/test_results_pages.py runs it on the repository):
a block name appears in exactly one page, once; a figure may be quoted in several places but
always with the value the data gives; every name is known here. The data: the JSON the
benchmarks write (``benchmarks/results/*.json``, each written by the command its block shows) and
the grid cells of ``scripts/results_cells.py`` (``docs/results/cells/``, its ``<!-- cells:SOURCE -->``
blocks, checked here too once the folder exists). A number in the pages with no data behind it is
in a section marked historical, with the commit it came from.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from masktrl.runs.retention import human  # bytes as `masktrl train` prints its projection

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?<!`)<!-- generated: (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /generated -->", re.S)
FIGURE = re.compile(r"(?<!`)<!-- fig: (?P<name>[\w.-]+) -->(?P<value>[^<\n]*)<!-- /fig -->")
BENCH = Path("benchmarks/results")


def pages(root: Path) -> list[Path]:
    """The pages that may hold generated text: README.md and docs/**/*.md."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _load(root: Path, name: str) -> dict:
    return json.loads((root / BENCH / name).read_text())


def _by_size(data: dict) -> dict[str, dict]:
    """{base recipe: its row}; the pages show one row per size, so every method overlay of a size
    must project the same disk (a ValueError names the one that does not)."""
    out: dict[str, dict] = {}
    for row in data["recipes"]:
        first = out.setdefault(row["recipe"].split(" + ")[0], row)
        if row["per_run"] != first["per_run"]:
            raise ValueError(f"{row['recipe']} projects another disk use than {first['recipe']}: one row per size")
    return out


def disk_projection(root: Path) -> str:
    whole = _by_size(_load(root, "disk_projection.json"))
    kept = _by_size(_load(root, "disk_projection_kept2.json"))
    lines = [
        "```bash",
        "python benchmarks/disk_projection.py --json benchmarks/results/disk_projection.json",
        "python benchmarks/disk_projection.py --set train.keep_checkpoints=2 --set rollout.store=resume \\",
        "    --json benchmarks/results/disk_projection_kept2.json",
        "```",
        "",
        "| recipes | ZeRO | B / token | rollouts / step | checkpoint (weights + optimizer) "
        "| everything kept (rollouts + checkpoints) | `keep_checkpoints: 2`, `rollout.store: resume` |",
        "|---|---|---|---|---|---|---|",
    ]
    for base, row in whole.items():
        k, ck = kept[base], row["checkpoint"]
        lines.append(
            f"| `{base}-*` ({row['params'] / 1e9:.2f} B parameters) | {row['zero_stage']} "
            f"| {row['bytes_per_token']:.1f} | {human(row['rollout_step'])} "
            f"| {human(sum(ck.values()))} ({human(ck['weights'])} + {human(ck['optimizer'])}) "
            f"| {human(row['rollouts'])} + {human(row['checkpoints'])} = **{human(row['per_run'])}** "
            f"| {human(k['rollouts'])} + {human(k['checkpoints'])} = **{human(k['per_run'])}** |"
        )
    return "\n".join(lines) + "\n"


def rollout_storage(root: Path) -> str:
    data = _load(root, "rollout_storage.json")
    m = data["machine"]
    lines = [
        "```bash",
        f"python benchmarks/rollout_storage.py --cases {' '.join(data['args']['cases'])} "
        f"--reps {data['args']['reps']} --json benchmarks/results/rollout_storage.json",
        "```",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, "
        f"torch threads {m['torch_threads']}; load {m['loadavg_1m']:.1f} at {m['time']}. Sizes do not "
        "depend on the machine or the load; the times (one round) do.",
        "",
        "| case (K = 20) | B/token format 1 | format 2 | smaller | format 2's bytes by column (B/token) "
        "| write ms 1 → 2 | read ms 1 → 2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, r in data["results"].items():
        cols = sorted(r["bytes_per_token_v2_by_column"].items(), key=lambda kv: -kv[1])
        by = ", ".join(f"{c} {v:.1f}" for c, v in cols if v >= 0.5)
        lines.append(
            f"| `{case}` | {r['bytes_per_token_v1']:.0f} | **{r['bytes_per_token_v2']:.1f}** "
            f"| {r['bytes_per_token_v1'] / r['bytes_per_token_v2']:.2f}× | {by} "
            f"| {r['write1_ms']:.1f} → {r['write2_ms']:.1f} | {r['read1_ms']:.1f} → {r['read2_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _head(data: dict, machine: str, header: str, rule: str) -> list[str]:
    """A benchmark block's first lines: its command, the machine line, and its table's header."""
    return ["```bash", data["command"], "```", "", machine, "", header, rule]


def _code(row: dict, base: str) -> str:
    """A runs_per_cpu_hour.py row's code in a table: the base commit, or this tree's variant."""
    return base if row["variant"] == "base" else row["variant"].removeprefix("this tree: ")


def runs_per_cpu_hour(root: Path, name: str = "runs_per_cpu_hour.json") -> str:
    """docs/BENCHMARKS.md's runs per CPU-hour (benchmarks/runs_per_cpu_hour.py) against the base commit."""
    data = _load(root, name)
    m = data["machine"]
    lines = _head(
        data,
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, "
        f"`train.threads` {data['threads']}; load {data['loadavg_1m_start']:.1f} at the start, "
        f"{m['loadavg_1m']:.1f} at the end ({m['time']}); {data['rounds']} round(s), "
        f"{'each preset with its own steps' if data['steps'] is None else str(data['steps']) + ' steps'}. CPU time is "
        "user + sys of the run's process tree; each run builds its own warm start."
        + (
            " Each round the base and each variant ran side by side, one per core; a variant's ratio is the "
            "median of its pairs' own ratios."
            if data.get("pairs")
            else ""
        ),
        f"| preset | code | CPU min per run | runs per CPU-hour | × {data['base']} | held-out before → after |",
        "|---|---|---|---|---|---|",
    )
    for row in data["rows"]:
        first = row["runs"][0]
        ratio = "" if row["ratio_vs_base"] is None else f"{row['ratio_vs_base']:.2f}×"
        code = _code(row, data["base"])
        lines.append(
            f"| {row['preset']} | {code} | {row['cpu_s'] / 60:.1f} | {row['runs_per_cpu_hour']:.1f} | {ratio} "
            f"| {first['eval_before']:.3f} → {first['eval_after']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def runs_per_cpu_hour_phases(root: Path, name: str = "runs_per_cpu_hour_phases.json") -> str:
    """docs/BENCHMARKS.md §7's phases of a lab run (runs_per_cpu_hour.py's ``phases_s``, by the runs'
    own clocks): each phase's share of the run's wall time, the ratio to the base had it cost nothing
    (``ratio_if_free``), and how short the phase alone would have to become for twice the base's runs
    per CPU-hour (none: not even at no cost)."""
    data = _load(root, name)
    phases = _benchmark("runs_per_cpu_hour").PHASES
    base = data["base"]
    lines = _head(
        data,
        f"{_cpu_line(data)}; {data['rounds']} round(s). Shares of a run's wall time (one thread: its CPU "
        "time too), the median over the rounds.",
        f"| preset | code | CPU min per run | × {base} | phase | share of the run | × {base} had it cost nothing "
        "| for 2× the phase alone at most |",
        "|---|---|---|---|---|---|---|---|",
    )
    for row in data["rows"]:
        runs = row["runs"]
        code = _code(row, base)
        ratio = row["ratio_vs_base"]
        free = row.get("ratio_if_free") or {}
        for k, phase in enumerate(phases):  # the run's order
            share = statistics.median(r["phases_s"][phase] / r["wall_s"] for r in runs)
            first = [row["preset"], code, f"{row['cpu_s'] / 60:.1f}", f"{ratio:.2f}×"] if k == 0 else [""] * 4
            need = ""
            if phase in free and ratio is not None and row["variant"] != "base":
                left = 1 - (1 - ratio / 2) / share  # the phase's time, as a share of today's, that gives 2x
                need = f"{100 * left:.0f} % of its time" if left > 0 else "not even at no cost"
            extra = [f"{free[phase]:.2f}×" if phase in free and row["variant"] != "base" else "", need]
            lines.append("| " + " | ".join([*first, phase, f"{100 * share:.0f} %", *extra]) + " |")
    return "\n".join(lines) + "\n"


def runs_per_cpu_hour_rounds(root: Path, name: str) -> str:
    """docs/BENCHMARKS.md §7's runs of one preset round by round, in the order they ran: each run's
    CPU seconds, its phases and its ratio to the base run of its own round (the benchmark reverses
    the order every other round), or, from ``--pairs``, to the base run it ran beside. This tree's
    warm starts are the same computation in every variant (the variants change the rollout and the
    update), so their spread is the machine's speed changing during the benchmark."""
    data = _load(root, name)
    base, phases = data["base"], _benchmark("runs_per_cpu_hour").PHASES
    rows = [r for r in data["rows"] if r["preset"] == data["rows"][0]["preset"]]
    pairs = any("paired_base_cpu_s" in run for r in rows for run in r["runs"])  # this preset ran in pairs
    threads = data.get("threads", 1)
    wall = threads > 1  # one thread: a run's wall seconds are its CPU seconds, and the table leaves them out
    lines = [
        f"| round | code | CPU s | {'wall s | ' if wall else ''}{' s | '.join(phases)} s "
        f"| × {base} {'beside it' if pairs else 'in its round'} |",
        "|---|---|---|" + "---|" * (len(phases) + wall) + "---|",
    ]

    def line(k: int, row: dict, run: dict, ratio: str) -> str:
        code = _code(row, base)
        cells = [str(k + 1), code, f"{run['cpu_s']:.0f}", *([f"{run['wall_s']:.0f}"] if wall else [])]
        cells += [*(f"{run['phases_s'][p]:.0f}" for p in phases), ratio]
        return "| " + " | ".join(cells) + " |"

    variants = [r for r in rows if r["variant"] != "base"]
    for k in range(data["rounds"]):
        if pairs:  # the base's runs: one beside each variant, round by round
            for j, row in enumerate(variants):
                run = row["runs"][k]
                lines.append(line(k, rows[0], rows[0]["runs"][k * len(variants) + j], ""))
                lines.append(line(k, row, run, f"{run['paired_base_cpu_s'] / run['cpu_s']:.2f}×"))
            continue
        base_cpu = next((r["runs"][k]["cpu_s"] for r in rows if r["variant"] == "base"), None)
        for row in rows if k % 2 == 0 else list(reversed(rows)):
            run = row["runs"][k]
            lines.append(line(k, row, run, f"{base_cpu / run['cpu_s']:.2f}×" if base_cpu is not None else ""))
    warm = [run["phases_s"]["warm start"] for r in variants for run in r["runs"]]
    lines += [
        "",
        f"This tree's warm start, the same computation in each of its {len(warm)} runs, took "
        f"{min(warm):.1f}-{max(warm):.1f} s, {max(warm) / min(warm) - 1:.0%} longer in its slowest run than in its "
        "fastest: that spread is the machine's, not the code's.",
    ]
    if wall:
        lines[-1] += (
            f" The phases are the runs' own clocks, in wall seconds; with {threads} threads a run's CPU seconds are "
            "more than its wall seconds."
        )
    return "\n".join(lines) + "\n"


def compile_update(root: Path, name: str = "compile_update.json") -> str:
    """docs/BENCHMARKS.md §7's lab update eager and compiled (benchmarks/compile_update.py): per
    variant the first update (with the compilation), the median later one, the updates of a lab
    run projected from them, the ratio to the eager packed update's, and each round's held-out
    accuracy after."""
    data = _load(root, name)
    lines = _head(
        data,
        f"{_cpu_line(data)}. {data['rounds']} round(s) of one {data['steps']}-step run per variant, each in "
        "a fresh process; the first update and the later ones' median are medians over the rounds, and "
        f"a {data['run_steps']}-step run's updates are projected as the first plus {data['run_steps'] - 1} later ones.",
        "| variant | forward | compiled | AdamW | first update s | later update s "
        f"| updates of a {data['run_steps']}-step run s | × eager packed | held-out after, per round |",
        "|---|---|---|---|---|---|---|---|---|",
    )
    for row in data["rows"]:
        packing, what, *rest = data["variants"][row["variant"]]  # runs before train.adamw: foreach
        ratio = row.get("ratio_vs_eager_packed", 1.0)
        n = rest[1] if len(rest) > 1 else 8  # the lab's: 8
        minibatches = f", {n} minibatch{'es' if n > 1 else ''}" if n != 8 else ""
        lines.append(
            f"| `{row['variant']}` | {'packed' if packing else 'padded'}{minibatches} | {what or 'nothing (eager)'} "
            f"| {rest[0] if rest else 'foreach'} "
            f"| {row['first_update_s']:.2f} | {row['later_update_s']:.3f} | {row['run_updates_s']:.0f} "
            f"| {ratio:.2f}× | {', '.join(f'{x:.3f}' for x in row['eval_after'])} |"
        )
    return "\n".join(lines) + "\n"


def adamw_kernels(root: Path, name: str = "adamw_kernels.json") -> str:
    """docs/BENCHMARKS.md §7's AdamW kernels side by side in one process (benchmarks/adamw_kernels.py):
    per kernel the median CPU ms per step, the ratio to foreach and a lab run's optimizer CPU
    seconds; under it the rounds' sign count, the median of their ratios and a run's saving."""
    data = _load(root, name)
    ms, updates = data["ms_per_step"], data["run_updates"]
    lines = _head(
        data,
        f"{_cpu_line(data)}. The lab policy's {data['parameters']:,} parameters in {data['tensors']} tensors; "
        f"{len(data['rounds'])} rounds of {data['steps']} steps per kernel, the order alternating.",
        f"| kernel | CPU ms per step | × foreach | CPU s over a lab run's {updates:,} steps |",
        "|---|---|---|---|",
    )
    for kernel in ("foreach", "fused"):
        lines.append(
            f"| `{kernel}` | {ms[kernel]:.2f} | {ms['foreach'] / ms[kernel]:.2f}× | {ms[kernel] * updates / 1e3:.1f} |"
        )
    lines += [
        "",
        f"`fused` was the faster in {data['fused_faster_rounds']} of the {len(data['rounds'])} rounds; "
        f"the median of the rounds' ratios is {data['round_ratio_median']:.2f}×; "
        f"a lab run saves {data['run_saving_cpu_s']:.1f} CPU s.",
    ]
    return "\n".join(lines) + "\n"


BF16_VARIANTS = {  # bf16_step.py's variants: what each computes, for the table
    "float32": "the model in float32",
    "bfloat16": "the model in bfloat16 (`model.dtype: bfloat16`)",
    "autocast": "float32 under `torch.autocast` (bfloat16)",
}


def bf16_step(root: Path, name: str = "bf16_step.json") -> str:
    """docs/BENCHMARKS.md §8's training step in bfloat16 against float32 in one process
    (benchmarks/bf16_step.py): per shape and variant the median CPU ms per step, the median of the
    rounds' ratios, the sign count and its verdict; per shape the step's GEMMs alone in each dtype."""
    data = _load(root, name)
    flags = ", ".join(data["cpu_bf16_flags"]) or "none"
    rounds = len(data["shapes"][0]["rounds"])
    lines = _head(
        data,
        f"{_cpu_line(data)}. bfloat16 features the CPU reports: {flags}; torch's CPU kernels: "
        f"{data['cpu_capability']}. {rounds} rounds per shape, the variants' blocks alternating; a variant is "
        f"faster (slower) when it wins (loses) at least {data['shapes'][0]['sign_test_threshold']} of the "
        f"{rounds} rounds (a two-sided sign test at 5 %).",
        "| shape | variant | CPU ms per step | × float32 | faster / slower rounds | verdict "
        "| the step's GEMMs alone, CPU ms |",
        "|---|---|---|---|---|---|---|",
    )
    for shape in data["shapes"]:
        g = shape["gemm_ms"]
        for v in BF16_VARIANTS:  # the JSON's keys are sorted: the table keeps the script's order
            row = shape["variants"][v]
            gemm = {"float32": f"{g['float32']:,.1f}", "bfloat16": f"{g['bfloat16']:,.1f} (bfloat16 operands)"}.get(
                v, ""
            )
            base = v == "float32"  # the reference: no rounds to count
            counts = "" if base else f"{row['faster_rounds']} / {row['slower_rounds']}"
            lines.append(
                f"| {shape['shape'] if base else ''} | {BF16_VARIANTS[v]} | {row['cpu_ms']:,.1f} "
                f"| {row['ratio_median']:.2f}× | {counts} | {row['verdict'] or ''} | {gemm} |"
            )
    return "\n".join(lines) + "\n"


def _bf16_figures(root: Path, name: str = "bf16_step.json", prefix: str = "bf16") -> dict[str, str]:
    """``<prefix>.<shape>.<variant>``: bf16_step.py's median ratio to float32;
    ``<prefix>.<shape>.gemm-ratio``: the step's GEMMs alone, float32 over bfloat16;
    ``<prefix>.<shape>.gemm-share``: their float32 share of the float32 step;
    ``<prefix>.<shape>.gemm-bound``: the step's ratio had its GEMMs alone gone bfloat16.
    ``bf16`` is the Intel Xeon's run (bf16_step.json), ``bf16-amd`` the AMD EPYC's (bf16_step_amd.json)."""
    out = {}
    for shape in _load(root, name)["shapes"]:
        key, g, step = f"{prefix}.{shape['shape']}", shape["gemm_ms"], shape["variants"]["float32"]["cpu_ms"]
        for v in ("bfloat16", "autocast"):
            out[f"{key}.{v}"] = f"{shape['variants'][v]['ratio_median']:.2f}×"
        out[f"{key}.gemm-ratio"] = f"{g['float32'] / g['bfloat16']:.1f}×"
        out[f"{key}.gemm-share"] = f"{g['float32'] / step:.0%}"
        out[f"{key}.gemm-bound"] = f"{step / (step - g['float32'] + g['bfloat16']):.2f}×"
    return out


GPU_CHECKS = (  # benchmarks/results/gpu_check/, in the order run
    "h200-hf-4steps.json",
    "h200-hf-2steps.json",
    "h100-zero2.json",
    "h100-hf.json",
    "h100-tiny-zero2.json",
    "h100-zero2-try2.json",
)
ZERO2_RUNS = {  # gpu_check.py's ZeRO-2 runs, in order (log names: gpu_check.log_path): their names in the table
    "full": "uninterrupted run",
    "crash": "run to be killed",
    "resume": "resume",
}


def _benchmark(name: str):
    """benchmarks/<name>.py as a module, so the generator reads its names (a parser, the phases)
    from the benchmark rather than repeating them."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def _gpu_check():
    """benchmarks/gpu_check.py as a module: its parser and its log names are the generator's."""
    return _benchmark("gpu_check")


def _gpu_check_args(argv: list[str]):
    """A recorded benchmarks/gpu_check.py invocation read by the script's own parser (its
    defaults: the methods and steps it ran when the command line did not name them)."""
    return _gpu_check().parse(argv)


def _zero2_row(folder: Path, name: str, args, data: dict) -> str:
    """The ZeRO-2 kill-and-resume phase of one GPU-check JSON as a table row."""
    z = data.get("zero2_resume")
    label = f"| {name} | ZeRO-2 kill + resume ({args.shape}) | 3 |"
    # ended: compared (``complete``; JSONs before it had the comparison's fields only) or failed
    if z is not None and ("error" in z or z.get("complete", "max_abs_weight_diff" in z)):
        if z["ok"]:
            return f"{label} ok: bit-identical weights and metrics after the resume | | | |"
        if "error" in z:
            return f"{label} failed: `{z['error'].strip().splitlines()[-1]}` | | | |"
        return f"{label} not ok: killed {z['killed']}, weight difference {z['max_abs_weight_diff']:.3g} | | | |"
    logs = {run: _gpu_check().log_path(folder / name, f"zero2-{run}") for run in ZERO2_RUNS}
    started = [run for run in ZERO2_RUNS if logs[run].exists()]
    where = f"in the {ZERO2_RUNS[started[-1]]} (log: `{logs[started[-1]].name}`)" if started else "(no log kept)"
    return f"{label} no result: the check was cut short {where} | | | |"


def gpu_check(root: Path) -> str:
    """docs/BENCHMARKS.md's GPU-check runs (benchmarks/gpu_check.py JSONs), one row per method asked
    for and one for the ZeRO-2 phase; then one line per machine and software."""
    folder = root / BENCH / "gpu_check"
    lines = [
        "| JSON | method | steps | result | step s (median) | generated tokens/s "
        "| sync: mean \\|Δ log p\\| synced → start |",
        "|---|---|---|---|---|---|---|",
    ]
    machines: dict[str, list[str]] = {}
    for name in GPU_CHECKS:
        data = json.loads((folder / name).read_text())
        args = _gpu_check_args(data["argv"])
        steps = args.steps
        for method in [m for m in args.methods.split(",") if m]:
            r = data["runs"].get(method)
            if r is None:
                lines.append(f"| {name} | {method} | {steps} | no result: the check was cut short | | | |")
            elif not r["ok"]:
                lines.append(f"| {name} | {method} | {steps} | failed: `{r['error'].strip().splitlines()[-1]}` | | | |")
            else:
                sync = r["weight_sync"]
                lines.append(
                    f"| {name} | {method} | {r['steps']} | ok | {r['step_time_s_median']:.1f} "
                    f"| {r['generation_tokens_per_s']:,.0f} | {sync['at_synced_weights']['mean_abs_dlogp']:.4f} → "
                    f"{sync['at_starting_weights']['mean_abs_dlogp']:.4f} ({'ok' if sync['sync_ok'] else 'not ok'}) |"
                )
        if args.zero2:
            lines.append(_zero2_row(folder, name, args, data))
        v = data["versions"]
        machine = (
            f"{v['gpu']} ({v['gpu_memory_gib']:.0f} GiB), Python {v['python']}, torch {v['torch']}, "
            f"transformers {v['transformers']}, accelerate {v['accelerate']}; vLLM "
            f"{v['vllm'] or 'absent'}, DeepSpeed {v['deepspeed'] or 'absent'}"
        )
        machines.setdefault(machine, []).append(name)
    lines.append("")
    lines += [f"- {', '.join(names)}: {machine}." for machine, names in machines.items()]
    return "\n".join(lines) + "\n"


QUIET_LOAD = 1.5  # the 1-minute load average at or under which a 2-core machine running a 1-thread benchmark is quiet
VS_TRL_SIDES = {  # vs_trl.py's side -> (its key in a shape's result, its row label)
    "masktrl": ("masktrl", "masktrl"),
    "masktrl-defaults": ("masktrl_defaults", "masktrl, nothing set: `auto` packs and drops finished rows"),
    "masktrl-unpacked": ("masktrl_unpacked", "masktrl, `train.packing` off"),
    "masktrl-unshared": ("masktrl_unshared", "masktrl, prompt sharing off"),
    "masktrl-neither": ("masktrl_neither", "masktrl, packing and prompt sharing off"),
    "masktrl-dropfinished": ("masktrl_dropfinished", "masktrl, `rollout.drop_finished`"),
}


def _cpu_line(data: dict) -> str:
    """A CPU benchmark's machine, torch, thread count and load span, for its block's machine line."""
    m = data["machine"]
    threads = data["threads"]
    return f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, `train.threads` {threads}; {_load_span(data)}"


def _load_span(data: dict) -> str:
    """A benchmark JSON's load at its start and end, and when it ended."""
    m = data["machine"]
    return f"load {data['loadavg_1m_start']:.1f} at the start, {m['loadavg_1m']:.1f} at the end ({m['time']})"


def vs_trl(root: Path) -> str:
    """docs/BENCHMARKS.md §1's masktrl vs TRL per step at both shapes (benchmarks/vs_trl.py --shape both)."""
    data = _load(root, "vs_trl.json")
    m = data["machine"]
    lines = _head(
        data,
        f"Machine: {m['cores']}-core {m['cpu']}, torch {m['torch']}, transformers {m['transformers']}, TRL "
        f"{m.get('trl', '?')}; {_load_span(data)}. Medians over the timed steps; the ratios are TRL's time per "
        "step over masktrl's (the wall ratio is the median of the paired blocks).",
        "| shape | side | settings | CPU ms per step | TRL CPU ms per step | CPU ratio | wall ratio |",
        "|---|---|---|---:|---:|---:|---:|",
    )
    for shape, r in data["shapes"].items():
        s = r["settings"]
        settings = f"{s['prompts_per_step']} × {s['group_size']}, ≤ {s['max_new_tokens']} new tokens"
        trl_ms = r["trl"]["cpu_ms_median"]
        for side, (key, label) in VS_TRL_SIDES.items():
            if key not in r:
                continue
            short = key.removeprefix("masktrl_")
            cpu = r["cpu_time_ratio"] if side == "masktrl" else r[f"{short}_cpu_time_ratio"]
            wall = r["speedup_vs_trl"] if side == "masktrl" else r[f"{short}_speedup_vs_trl"]
            default = " (the defaults)" if side == r.get("default_side") else ""
            if shape == "long" and side == "masktrl":
                label = "masktrl, `train.packing` on"
            if shape == "long" and side == "masktrl-unpacked" and "masktrl_defaults" in r:
                label = "masktrl, `train.packing` and `rollout.drop_finished` off"
            if shape == "long" and side == "masktrl-dropfinished":
                label = "masktrl, `train.packing` on and `rollout.drop_finished`"
            ratio = f"**{_ratio_against(cpu, r['goal'])}×**" if default else f"{cpu:.2f}×"
            lines.append(
                f"| {shape} | {label}{default} | {settings} | {r[key]['cpu_ms_median']:,.0f} | {trl_ms:,.0f} | "
                f"{ratio} | {wall:.2f}× |"
            )
    loads = (data["loadavg_1m_start"], m["loadavg_1m"])
    quiet = max(loads) <= QUIET_LOAD
    lines.append("")
    lines.append(
        "Goals (issue #39, CPU time with the defaults"
        + ("" if quiet else f"; read at load {min(loads):.1f}-{max(loads):.1f}, not on a quiet machine, so no verdict")
        + "): "
        + "; ".join(
            f"{shape} ≥ {r['goal']}×: "
            + (
                f"{'met' if r['goal_met'] else 'not met'} ({_ratio_against(r['default_cpu_time_ratio'], r['goal'])}×)"
                if quiet
                else f"{r['default_cpu_time_ratio']:.2f}×"
            )
            for shape, r in data["shapes"].items()
        )
        + "."
    )
    return "\n".join(lines) + "\n"


def _ratio_against(ratio: float, goal: float) -> str:
    """``ratio`` to 2 decimals, or 3 where 2 would read as the goal it misses (2.498 is not 2.50)."""
    text = f"{ratio:.2f}"
    return f"{ratio:.3f}" if ratio < goal and float(text) >= goal else text


def _vs_trl_figures(root: Path) -> dict[str, str]:
    """``vs-trl.<shape>``: TRL's CPU time per step over masktrl's with the defaults, at that shape;
    ``vs-trl.<shape>.blocks``: the range of the paired blocks' wall ratios (masktrl's main side)."""
    shapes = _load(root, "vs_trl.json")["shapes"]
    out = {
        f"vs-trl.{shape}": f"{_ratio_against(r['default_cpu_time_ratio'], r['goal'])}×" for shape, r in shapes.items()
    }
    for shape, r in shapes.items():
        blocks = r["speedup_per_rep"]
        out[f"vs-trl.{shape}.blocks"] = f"{min(blocks):.2f}-{max(blocks):.2f}×"
    # the run before train.packing / rollout.drop_finished: auto (vs_trl_previous.json: both off by default)
    previous = _load(root, "vs_trl_previous.json")["shapes"]
    out["vs-trl-previous.default"] = f"{previous['default']['default_cpu_time_ratio']:.2f}×"
    out["vs-trl-previous.long.both-on"] = f"{previous['long']['dropfinished_cpu_time_ratio']:.2f}×"
    out["vs-trl-previous.long.trl-ms"] = f"{previous['long']['trl']['cpu_ms_median']:,.0f}"
    # the run when auto became the default, before the shared prompt keys in decoding (vs_trl_auto.json)
    auto = _load(root, "vs_trl_auto.json")["shapes"]
    for shape, r in auto.items():
        out[f"vs-trl-auto.{shape}"] = f"{_ratio_against(r['default_cpu_time_ratio'], r['goal'])}×"
    out["vs-trl-auto.long.trl-ms"] = f"{auto['long']['trl']['cpu_ms_median']:,.0f}"
    out["vs-trl-auto.long.masktrl-ms"] = f"{auto['long']['masktrl_defaults']['cpu_ms_median']:,.0f}"
    # the same command's earlier quiet run (vs_trl_earlier.json: before rollout.decode: auto, default rows ran generate)
    for shape, r in _load(root, "vs_trl_earlier.json")["shapes"].items():
        out[f"vs-trl-earlier.{shape}"] = f"{r['default_cpu_time_ratio']:.2f}×"
        out[f"vs-trl-earlier.{shape}.trl-ms"] = f"{r['trl']['cpu_ms_median']:,.0f}"
    return out


MFU_GOALS = {"long": 0.60, "lab": 0.45}  # issue #39.2: the packed step's MFU (wall) at each shape
MFU_VARIANT = "packed, shared prompt"  # the packed layout masktrl trains with when a group shares its prompt


def roofline_training(root: Path) -> str:
    """docs/BENCHMARKS.md §8's training forward + backward against the GEMM peak (benchmarks/roofline.py)."""
    data = _load(root, "roofline_training.json")
    m, peak = data["machine"], data["matmul_peak_flops"] / 1e9
    lines = _head(
        data,
        f"Machine: {m['cores']}-core {m['cpu']}, torch {m['torch']}, {data['threads']} thread; {_load_span(data)}. "
        f"Peak: a 4096² float32 GEMM, {peak:,.1f} GFLOP/s ({data['matmul_peak_flops_per_cpu_s'] / 1e9:,.1f} per "
        "CPU-second). Medians over the timed repetitions, the variants alternating.",
        "| shape | variant | ms | CPU ms | tokens run | model GFLOP | MFU (wall) | MFU (CPU time) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    )
    for r in data["training"]:
        lines.append(
            f"| {r['shape']} | {r['variant']} | {r['time_ms']:,.1f} | {r['cpu_ms']:,.1f} | {r['tokens_run']:,} | "
            f"{r['model_gflop']:,.2f} | {100 * r['mfu']:.1f} % | {100 * r['mfu_cpu_time']:.1f} % |"
        )
    loads = (data["loadavg_1m_start"], m["loadavg_1m"])
    goals = []
    for shape, goal in MFU_GOALS.items():
        row = next(r for r in data["training"] if r["shape"] == shape and r["variant"] == MFU_VARIANT)
        verdict = "met" if row["mfu"] >= goal else "not met"
        goals.append(f"{shape} ≥ {100 * goal:.0f} %: {verdict} ({100 * row['mfu']:.1f} %)")
    lines.append("")
    lines.append(
        f"Goals (issue #39.2, MFU in wall time of the `{MFU_VARIANT}` step"
        + ("" if max(loads) <= QUIET_LOAD else f"; read at load {min(loads):.1f}-{max(loads):.1f}, so no verdict")
        + "): "
        + "; ".join(goals)
        + "."
    )
    return "\n".join(lines) + "\n"


def _roofline_training_figures(root: Path) -> dict[str, str]:
    """``roofline.train.<shape>``: the MFU (wall) of the shape's ``MFU_VARIANT`` step."""
    rows = _load(root, "roofline_training.json")["training"]
    return {f"roofline.train.{r['shape']}": f"{100 * r['mfu']:.1f} %" for r in rows if r["variant"] == MFU_VARIANT}


MISMATCH_SIDES = {  # mismatch_reuse.py's side -> its row label in docs/BENCHMARKS.md
    "auto": "`auto` (log π_old from the decoupled forward)",
    "always": "`always` (the separate forward after sampling)",
    "off": "`off` (not measured)",
}


def mismatch_reuse(root: Path) -> str:
    """docs/BENCHMARKS.md's per-step CPU time of the mismatch metric's modes (benchmarks/mismatch_reuse.py)."""
    data = _load(root, "mismatch_reuse.json")
    m, reps = data["machine"], data["reps"]
    lines = [
        "```bash",
        data["command"],
        "```",
        "",
        f"Machine: {m['cores']}-core {m['cpu']}, torch {m['torch']}, {data['settings']['threads']} torch thread, "
        f"load average {m['loadavg_1m']:.1f} at the end ({m['time']}); {data['elapsed_s']:.0f} s.",
        "",
        "| side | CPU ms per step (median) | CPU time / `auto` | wall / `auto` |",
        "|---|---|---|---|",
    ]
    for side, label in MISMATCH_SIDES.items():
        ms = sorted(r[side]["cpu_step_s"] for r in reps)
        mid = len(ms) // 2
        median_ms = (ms[mid] if len(ms) % 2 else (ms[mid - 1] + ms[mid]) / 2) * 1e3
        per = [r[side]["cpu_step_s"] / r["auto"]["cpu_step_s"] for r in reps]
        ratio = "1" if side == "auto" else f"{data['cpu_ratio_to_auto'][side]:.2f}"
        if side == "always":
            ratio = f"**{ratio}** (per repeat {min(per):.2f}-{max(per):.2f})"
        wall = "1" if side == "auto" else f"{data['wall_ratio_to_auto'][side]:.2f}"
        lines.append(f"| {label} | {median_ms:,.0f} | {ratio} | {wall} |")
    return "\n".join(lines) + "\n"


GEN_VARIANTS = {  # gen_vs_base.py's variant -> its row label in docs/BENCHMARKS.md
    "generate": "`generate` (this tree)",
    "fused": "`decode: fused` (bit-identical)",
    "fused+inverse_cdf": "`decode: fused`, `draw: inverse_cdf`",
    "drop_finished+inverse_cdf": "`drop_finished`, `draw: inverse_cdf`",
    "floor": "floor: the records' operations alone (not an engine)",
}


def gen_vs_base(root: Path, name: str = "gen_vs_base.json") -> str:
    """docs/BENCHMARKS.md's generation tokens per CPU-second against the base commit (benchmarks/gen_vs_base.py)."""
    data = _load(root, name)
    m = data["machine"]
    top_p = data.get("top_p", 1.0)
    sampling = f" Every engine samples with top-p {top_p:g}." if top_p < 1 else ""
    threads = f"{data['threads']} torch thread{'s' if data['threads'] > 1 else ''}"
    lines = [
        f"Machine: {m['cores']}-core {m['cpu']}, {threads} per process "
        f"(1-minute load average {data['loadavg_1m_start']:.1f} at the start, {m['loadavg_1m']:.1f} at the "
        f"end, {m['time']}); {data['rounds']} rounds of {data['reps']} batches.{sampling}",
        "",
        f"| rows | variant | tokens per CPU-s | vs {data['base']} (CPU) | vs {data['base']} (wall) |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in data["rows"]:
        base = r["variant"].startswith("base:")
        label = f"{data['base']} `{r['variant'].removeprefix('base:')}`" if base else GEN_VARIANTS[r["variant"]]
        cpu = f"{r['ratio_vs_base_cpu']:.2f}"
        lines.append(
            f"| {r['rows']} | {label} | {r['tokens_per_cpu_s']:,.0f} | "
            f"{'**' + cpu + '**' if r['variant'] == 'fused+inverse_cdf' else cpu} | {r['ratio_vs_base_wall']:.2f} |"
        )
    return "\n".join(lines) + "\n"


GEN_OPS = {  # gen_vs_base.py --ops's operation -> its figure's name
    "multinomial": "multinomial",
    "exponential_": "exponential",
    "lm_head": "lm_head",
    "topk": "topk",
    "softmax": "softmax",
    "log_softmax": "log_softmax",
    "inverse_cdf (blocks of 64)": "inverse_cdf",
    "exp + float64 cumsum, reused buffers": "exp-cumsum-reused",
    "exp + float64 cumsum, fresh tensors": "exp-cumsum-fresh",
}


def _gen_ops_figures(root: Path) -> dict[str, str]:
    """``gen-ops.<op>``: one operation's CPU milliseconds per decode step (gen_vs_base.py --ops), and
    ``roofline.gen.<shape>.<variant>``: roofline.py's generated tokens per CPU-second."""
    ops = _load(root, "gen_ops.json")["ops_cpu_ms"]
    out = {f"gen-ops.{GEN_OPS[op]}": f"{ms:.1f} ms" for op, ms in ops.items()}
    for g in _load(root, "roofline_generation.json")["generation"]:
        out[f"roofline.gen.{g['shape']}.{g['variant'].replace('+', '-')}"] = f"{g['tokens_per_cpu_s']:,.0f}"
    lab = {
        g["variant"]: g["tokens_per_cpu_s"]
        for g in _load(root, "roofline_generation.json")["generation"]
        if g["shape"] == "lab"
    }
    out["roofline.gen.lab.fused-icdf-ratio"] = f"{lab['fused+icdf'] / lab['generate']:.2f}x"
    return out


def _gen_figures(root: Path) -> dict[str, str]:
    """``gen.<variant>.<rows>`` (``+`` in a variant's name as ``-``): its tokens per CPU-second over the base's."""
    rows = _load(root, "gen_vs_base.json")["rows"]
    out = {
        f"gen.{r['variant'].replace('+', '-')}.{r['rows']}": f"{r['ratio_vs_base_cpu']:.2f}x"
        for r in rows
        if ":" not in r["variant"]
    }
    # the floor (gen_vs_base.py's FLOOR_CHILD): its rounds' spread over the base's median, and the share of it the
    # fused loop with the inverse-CDF draw reaches
    for n in sorted({r["rows"] for r in rows}):
        by = {r["variant"]: r for r in rows if r["rows"] == n}
        if "floor" not in by:
            continue
        base = by["base:generate"]["tokens_per_cpu_s"]
        rounds = [x["tokens"] / x["cpu_s"] / base for x in by["floor"]["runs"]]
        out[f"gen.floor.{n}.rounds"] = f"{min(rounds):.2f}x to {max(rounds):.2f}x"
        if "fused+inverse_cdf" in by:
            share = by["fused+inverse_cdf"]["tokens_per_cpu_s"] / by["floor"]["tokens_per_cpu_s"]
            out[f"gen.fused-inverse_cdf.{n}.of-floor"] = f"{100 * share:.0f} %"
    return out


def probes(root: Path) -> str:
    """The probe table of scripts/probe_regimes.py from its cells (docs/results/cells/<probe>/)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import probe_regimes

    return probe_regimes.probe_table(root / "docs" / "results" / "cells")


def grid_block(script: str, table: str, cells: str = "CELLS") -> Callable[[Path], str]:
    """A block that ``scripts/<script>.py``'s ``table`` function renders from the committed cells in
    its folder ``<script>.<cells>`` (RESULTS §1's long-lab controls, §2's agentic grid, LAB.md's
    agentic preset)."""

    def render(root: Path) -> str:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        module = importlib.import_module(script)
        return getattr(module, table)(root / getattr(module, cells))

    render.__doc__ = f"scripts/{script}.py's {table} of its {cells} folder."
    return render


BLOCKS: dict[str, Callable[[Path], str]] = {
    "disk-projection": disk_projection,
    "rollout-storage": rollout_storage,
    "probes": probes,
    "runs-per-cpu-hour": runs_per_cpu_hour,
    "runs-per-cpu-hour-new-labs": partial(runs_per_cpu_hour, name="runs_per_cpu_hour_new_labs.json"),
    "runs-per-cpu-hour-credit": partial(runs_per_cpu_hour, name="runs_per_cpu_hour_credit.json"),
    "runs-per-cpu-hour-lab": partial(runs_per_cpu_hour, name="runs_per_cpu_hour_lab.json"),
    "runs-per-cpu-hour-lab-packed": partial(runs_per_cpu_hour, name="runs_per_cpu_hour_lab_packed.json"),
    "runs-per-cpu-hour-phases": runs_per_cpu_hour_phases,
    "compile-update": compile_update,
    "compile-update-adamw": partial(compile_update, name="compile_update_adamw.json"),
    "compile-update-minibatches": partial(compile_update, name="compile_update_minibatches.json"),
    "adamw-kernels": adamw_kernels,
    "adamw-kernels-amd": partial(adamw_kernels, name="adamw_kernels_amd.json"),
    "bf16-step": bf16_step,
    "bf16-step-amd": partial(bf16_step, name="bf16_step_amd.json"),
    "runs-per-cpu-hour-lab-grouped": partial(runs_per_cpu_hour, name="runs_per_cpu_hour_lab_grouped.json"),
    "runs-per-cpu-hour-lab-parts4": partial(runs_per_cpu_hour, name="runs_per_cpu_hour_lab_parts4.json"),
    "runs-per-cpu-hour-lab-parts4-rounds": partial(runs_per_cpu_hour_rounds, name="runs_per_cpu_hour_lab_parts4.json"),
    "runs-per-cpu-hour-lab-pairs": partial(runs_per_cpu_hour, name="runs_per_cpu_hour_lab_pairs.json"),
    "runs-per-cpu-hour-lab-pairs-rounds": partial(runs_per_cpu_hour_rounds, name="runs_per_cpu_hour_lab_pairs.json"),
    "runs-per-cpu-hour-lab-fused": partial(runs_per_cpu_hour, name="runs_per_cpu_hour_lab_fused.json"),
    "runs-per-cpu-hour-lab-fused-rounds": partial(runs_per_cpu_hour_rounds, name="runs_per_cpu_hour_lab_fused.json"),
    "runs-per-cpu-hour-lab-fused-amd": partial(runs_per_cpu_hour, name="runs_per_cpu_hour_lab_fused_amd.json"),
    "runs-per-cpu-hour-lab-fused-amd-rounds": partial(
        runs_per_cpu_hour_rounds, name="runs_per_cpu_hour_lab_fused_amd.json"
    ),
    "runs-per-cpu-hour-lab-threads2": partial(runs_per_cpu_hour, name="runs_per_cpu_hour_lab_threads2.json"),
    "runs-per-cpu-hour-lab-threads2-rounds": partial(
        runs_per_cpu_hour_rounds, name="runs_per_cpu_hour_lab_threads2.json"
    ),
    "gpu-check": gpu_check,
    "gen-vs-base": gen_vs_base,
    "gen-vs-base-topp": partial(gen_vs_base, name="gen_vs_base_topp.json"),
    "gen-vs-base-threads2": partial(gen_vs_base, name="gen_vs_base_threads2.json"),
    "vs-trl": vs_trl,
    "roofline-training": roofline_training,
    "mismatch-reuse": mismatch_reuse,
    "long-controls-outcomes": grid_block("long_controls", "outcome_table"),
    "long-controls-family": grid_block("long_controls", "family_table"),
    "long-controls-threads2": grid_block("long_controls", "outcome_table", "CELLS_THREADS2"),
    "minibatch-groups-outcomes": grid_block("minibatch_groups", "outcome_table"),
    "minibatch-groups-comparison": grid_block("minibatch_groups", "comparison_table"),
    "minibatch-groups-threads2": grid_block("minibatch_groups", "outcome_table", "CELLS_THREADS2"),
    "minibatch-groups-drift": grid_block("minibatch_groups", "drift_table"),
    "minibatch-groups-dose": grid_block("minibatch_groups", "dose_table", "CELLS_PARTS"),
    "minibatch-groups-trend": grid_block("minibatch_groups", "trend_table", "CELLS_PARTS"),
    "minibatch-groups-steps": grid_block("minibatch_groups", "steps_table", "CELLS_PARTS"),
    "minibatch-groups-dose-threads2": grid_block("minibatch_groups", "dose_table", "CELLS_PARTS_THREADS2"),
    "minibatch-groups-size-outcomes": grid_block("minibatch_groups", "outcome_table", "CELLS_SIZE"),
    "minibatch-groups-size-comparison": grid_block("minibatch_groups", "comparison_table", "CELLS_SIZE"),
    "minibatch-groups-size": grid_block("minibatch_groups", "size_table", "CELLS_SIZE"),
    "minibatch-groups-size-threads2": grid_block("minibatch_groups", "outcome_table", "CELLS_SIZE_THREADS2"),
    "minibatch-groups-where-outcomes": grid_block("minibatch_groups", "where_outcomes", "CELLS_WHERE"),
    "minibatch-groups-where-comparison": grid_block("minibatch_groups", "where_table", "CELLS_WHERE"),
    "minibatch-groups-where-pooled": grid_block("minibatch_groups", "where_pooled_table", "CELLS_WHERE"),
    "agentic-outcomes": grid_block("agentic_grid", "outcome_table"),
    "agentic-family": grid_block("agentic_grid", "family_table"),
    "agentic-preset": grid_block("agentic_grid", "preset_table"),
}


PROBE_LABS = ("fp8-e2e", "async-geometric", "moe-fp8", "deep-fp8")  # the lab probes that are not long or top-p


def _pm(x: float, digits: int) -> str:
    """A signed figure with a true minus sign, as the results pages print them."""
    return f"{x:+.{digits}f}".replace("-", "\u2212")


def _results_figures(root: Path) -> dict[str, str]:
    """The figures docs/RESULTS.md quotes in its readings, from the committed cells."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import agentic_grid
    import long_controls

    cells = root / "docs" / "results" / "cells"

    def gains(*probes: str) -> list[float]:
        return [
            r["eval_after"] - r["eval_before"]
            for name in probes
            for path in sorted((cells / name).glob("*.json"))
            for r in json.loads(path.read_text())["runs"]
        ]

    out = {}
    for name, probes in (("long-fp8", ("long-fp8",)), ("others", PROBE_LABS)):
        g = gains(*probes)
        out[f"probes.{name}.gains"] = f"{_pm(min(g), 2)} to {_pm(max(g), 2)}"
    for path in sorted((cells / "top-p").glob("*.json")):
        for r in json.loads(path.read_text())["runs"]:
            out[f"probes.top-p.seed{r['seed']}"] = _pm(r["eval_after"] - r["eval_before"], 3)
    rows = {r["arm"]: r for r in long_controls.family_rows(long_controls.read(root / long_controls.CELLS))}
    for key, arm in (("dppo", "dppo (top-K KL)"), ("icepop", "decoupled IcePop")):
        out[f"long-controls.{key}.delta"] = _pm(sum(rows[arm]["d"]) / len(rows[arm]["d"]), 2)
    out["long-controls.learners.holm-p"] = (
        f"{max(rows[a]['holm'] for a in ('dppo (top-K KL)', 'decoupled IcePop')):.3f}"
    )
    mdd = [r["mdd"] for r in agentic_grid.family_rows(agentic_grid.read(root / agentic_grid.CELLS))]
    out["agentic.mdd-range"] = f"{min(mdd):.1f}-{max(mdd):.1f}"
    return out


def figures(root: Path) -> dict[str, str]:
    """Every figure a page may quote inline, by name."""
    whole = _by_size(_load(root, "disk_projection.json"))
    kept = _by_size(_load(root, "disk_projection_kept2.json"))
    out = {f"disk.{b}.whole": human(r["per_run"]) for b, r in whole.items()}
    out |= {f"disk.{b}.kept2": human(r["per_run"]) for b, r in kept.items()}
    for b, r in whole.items():
        ck = r["checkpoint"]
        out |= {f"disk.{b}.checkpoint": human(sum(ck.values())), f"disk.{b}.checkpoint-weights": human(ck["weights"])}
        out[f"disk.{b}.checkpoint-optimizer"] = human(ck["optimizer"])
    out |= {f"disk.{b}.kept2-all-rollouts": human(whole[b]["rollouts"] + r["checkpoints"]) for b, r in kept.items()}
    out["rollout.bytes-per-token.bf16"] = f"{whole['qwen3-4b']['bytes_per_token']:.1f}"
    for case, r in _load(root, "rollout_storage.json")["results"].items():
        out[f"rollout.bytes-per-token.{case}"] = f"{r['bytes_per_token_v2']:.1f}"
    worst = _load(root, "disk_projection_measured.json")
    out["rollout.bytes-per-token.worst"] = f"{worst['bytes_per_token']:.1f}"
    reuse = _load(root, "mismatch_reuse.json")
    out["mismatch-reuse.saving"] = f"{reuse['saving_cpu_frac']:.1%}"
    return (
        out
        | _gen_figures(root)
        | _gen_ops_figures(root)
        | _vs_trl_figures(root)
        | _roofline_training_figures(root)
        | _results_figures(root)
        | _runs_figures(root)
        | _adamw_figures(root)
        | _adamw_run_figures(root)
        | _bf16_figures(root)
        | _bf16_figures(root, "bf16_step_amd.json", "bf16-amd")
        | _threads2_figures(root)
        | _minibatch_figures(root)
    )


def _threads2_figures(root: Path) -> dict[str, str]:
    """``threads2.*``: runs_per_cpu_hour.py's lab at ``train.threads`` 2, before the shared-prompt
    backward was made repeatable (``threads2.before.*``, runs_per_cpu_hour_lab_threads2_before.json)
    and after (``threads2.after.*``): ``fast-fused``'s held-out accuracy after RL round by round and
    its ratio to the base; ``threads2.cpu-per-wall``: the after run's CPU seconds per wall second,
    lowest to highest over its runs."""
    out = {}
    for when, name in (
        ("before", "runs_per_cpu_hour_lab_threads2_before.json"),
        ("after", "runs_per_cpu_hour_lab_threads2.json"),
    ):
        fused = next(r for r in _load(root, name)["rows"] if r["variant"] == "this tree: fast-fused")
        out[f"threads2.{when}.held-out"] = " and ".join(f"{run['eval_after']:.3f}" for run in fused["runs"])
        out[f"threads2.{when}.fast-fused"] = f"{fused['ratio_vs_base']:.2f}×"
    per_wall = [
        run["cpu_s"] / run["wall_s"]
        for r in _load(root, "runs_per_cpu_hour_lab_threads2.json")["rows"]
        for run in r["runs"]
    ]
    out["threads2.cpu-per-wall"] = f"{min(per_wall):.2f} to {max(per_wall):.2f}"
    return out


def _minibatch_figures(root: Path) -> dict[str, str]:
    """``minibatches.*``: compile_update.py's minibatches-2 and minibatches-1 runs against
    eager-packed (compile_update_minibatches.json). ``.tokens``: the response tokens of the later
    updates, lowest to highest over the rounds; ``.per-token``: the ratio of the later updates'
    seconds per response token (each run's median, then the median over the rounds). From
    eager-packed's and minibatches-2's, with ``t = m a + B`` for m minibatches (a paid once per
    minibatch, B per row): ``minibatches.per-minibatch-share``, ``8 a / t`` at the lab's 8;
    ``minibatches.limit``, ``t / B``, the ratio with the per-minibatch part shared out entirely;
    ``minibatches.minibatches-1.predicted``, the ratio the same fit gives for one minibatch."""
    rows = {row["variant"]: row for row in _load(root, "compile_update_minibatches.json")["rows"]}

    def per_token(name: str) -> float:
        return statistics.median(
            statistics.median(s / n for s, n in zip(run["update_s"][1:], run["update_tokens"][1:]))
            for run in rows[name]["runs"]
        )

    out = {}
    for name in rows:
        tokens = [n for run in rows[name]["runs"] for n in run["update_tokens"][1:]]
        out[f"minibatches.{name}.tokens"] = f"{min(tokens):,} to {max(tokens):,}"
        if name != "eager-packed":
            out[f"minibatches.{name}.per-token"] = f"{per_token('eager-packed') / per_token(name):.2f}×"
    t8, t2 = per_token("eager-packed"), per_token("minibatches-2")
    a = (t8 - t2) / 6
    out["minibatches.per-minibatch-share"] = f"{8 * a / t8:.0%}"
    out["minibatches.limit"] = f"{t8 / (t8 - 8 * a):.2f}×"
    out["minibatches.minibatches-1.predicted"] = f"{t8 / (t8 - 7 * a):.2f}×"
    return out


def _adamw_figures(root: Path) -> dict[str, str]:
    """``adamw.*``: compile_update.py's adamw-fused run round by round: in how many rounds the fused
    kernel's median later update was the lower, each round's ratio (eager-packed's median over
    adamw-fused's), and the range of eager-packed's round medians."""
    data = _load(root, "compile_update_adamw.json")
    rows = {row["variant"]: row for row in data["rows"]}

    def medians(name: str) -> list[float]:
        return [statistics.median(run["update_s"][1:]) for run in rows[name]["runs"]]

    base, fused = medians("eager-packed"), medians("adamw-fused")
    ratios = [f"{b / f:.2f}×" for b, f in zip(base, fused)]
    return {
        "adamw.faster-rounds": f"{sum(f < b for b, f in zip(base, fused))} of the {len(base)}",
        "adamw.round-ratios": ", ".join(ratios[:-1]) + f" and {ratios[-1]}",
        "adamw.base-range": f"{min(base):.2f} s to {max(base):.2f} s",
    }


def _adamw_run_figures(root: Path) -> dict[str, str]:
    """``adamw.run-share``: what adamw_kernels.py's saving per lab run is of the fast-packed lab
    run's CPU seconds in runs_per_cpu_hour.py's pairs run (the same machine); ``adamw.projected``:
    that run's ratio to the base commit with its CPU time less the saving."""
    saved = _load(root, "adamw_kernels.json")["run_saving_cpu_s"]
    rows = _load(root, "runs_per_cpu_hour_lab_pairs.json")["rows"]
    packed = next(r for r in rows if r["variant"] == "this tree: fast-packed")
    return {
        "adamw.run-share": f"{saved / packed['cpu_s']:.1%}",
        "adamw.projected": f"{packed['ratio_vs_base'] * packed['cpu_s'] / (packed['cpu_s'] - saved):.2f}×",
    }


def _runs_figures(root: Path) -> dict[str, str]:
    """``runs.lab-grouped.<variant>``: each variant's runs per CPU-hour over the base commit's in
    benchmarks/runs_per_cpu_hour.py's newest lab run (with the fast-grouped variant)."""
    data = _load(root, "runs_per_cpu_hour_lab_grouped.json")
    return {
        f"runs.lab-grouped.{row['variant'].removeprefix('this tree: ')}": f"{row['ratio_vs_base']:.2f}×"
        for row in data["rows"]
        if row["ratio_vs_base"] is not None and row["variant"] != "base"
    }


def _cells(root: Path) -> dict[str, str]:
    """The ``<!-- cells:SOURCE -->`` tables of scripts/results_cells.py, when its cells are committed."""
    folder = root / "docs" / "results" / "cells"
    if not folder.is_dir():
        return {}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import results_cells

    return results_cells.tables(folder)


def render(root: Path) -> tuple[dict[str, str], dict[str, str]]:
    return {name: make(root) for name, make in BLOCKS.items()}, figures(root)


def rewrite(text: str, blocks: dict[str, str], figs: dict[str, str]) -> str:
    """``text`` with every known block and figure replaced by what the data gives (unknown ones kept)."""
    text = BLOCK.sub(
        lambda m: (
            f"<!-- generated: {m['name']} -->\n{blocks[m['name']]}<!-- /generated -->"
            if m["name"] in blocks
            else m.group(0)
        ),
        text,
    )
    return FIGURE.sub(
        lambda m: f"<!-- fig: {m['name']} -->{figs[m['name']]}<!-- /fig -->" if m["name"] in figs else m.group(0), text
    )


def problems(texts: dict[str, str], blocks: dict[str, str], figs: dict[str, str]) -> list[str]:
    """Every breach of the rules over ``texts`` ({page name: text}), one line each; [] when none."""
    out = []
    where: dict[str, list[str]] = {}
    quoted: dict[str, set[str]] = {}
    for page, text in texts.items():
        for m in BLOCK.finditer(text):
            where.setdefault(m["name"], []).append(page)
            if m["name"] not in blocks:
                out.append(f"{page}: block {m['name']!r} has no generator in scripts/results_pages.py")
            elif m["body"] != blocks[m["name"]]:
                out.append(f"{page}: block {m['name']!r} differs from its data (run scripts/results_pages.py --write)")
        for m in FIGURE.finditer(text):
            quoted.setdefault(m["name"], set()).add(m["value"])
            if m["name"] not in figs:
                out.append(f"{page}: figure {m['name']!r} has no data in scripts/results_pages.py")
            elif m["value"] != figs[m["name"]]:
                out.append(f"{page}: figure {m['name']!r} is {m['value']!r}, its data gives {figs[m['name']]!r}")
    for name in blocks:
        if len(where.get(name, [])) != 1:
            out.append(f"block {name!r} appears {len(where.get(name, []))} times (in {where.get(name, [])}): once only")
    for name, values in quoted.items():
        if len(values) > 1:
            out.append(f"figure {name!r} has {len(values)} values across the pages: {sorted(values)}")
    return out


def check(root: Path) -> list[str]:
    blocks, figs = render(root)
    texts = {p.relative_to(root).as_posix(): p.read_text() for p in pages(root) if p.is_file()}
    out = problems(texts, blocks, figs)
    made = _cells(root)
    if made:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import results_cells

        out += [f"docs/RESULTS.md: cells:{s} differs" for s in results_cells.check(root / "docs/RESULTS.md", made)]
    return out


def write(root: Path) -> list[Path]:
    blocks, figs = render(root)
    changed = []
    for page in pages(root):
        if not page.is_file():
            continue
        old = page.read_text()
        new = rewrite(old, blocks, figs)
        if new != old:
            page.write_text(new)
            changed.append(page)
    made = _cells(root)
    if made:
        import results_cells

        results_cells.rewrite(root / "docs/RESULTS.md", made)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the generated blocks and figures from the data")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        if args.write:
            for p in write(args.root):
                print(f"rewrote {p.relative_to(args.root)}")
        bad = check(args.root)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
