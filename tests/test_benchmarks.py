"""The benchmark scripts still run and still time what they claim to (no timing is asserted)."""

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = [
    "--set",
    "model.hidden_size=32",
    "--set",
    "model.num_layers=1",
    "--set",
    "model.num_heads=2",
    "--set",
    "model.num_kv_heads=1",
    "--set",
    "model.intermediate_size=64",
    "--set",
    "warmstart.steps=5",
    "--set",
    "rollout.prompts_per_step=4",
    "--set",
    "rollout.n=3",
    "--set",
    "rollout.max_new_tokens=3",
    "--set",
    "task.n_test=8",
]


@pytest.fixture
def common(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKTRL_BENCH_OUT", str(tmp_path))
    monkeypatch.syspath_prepend(str(BENCH))
    for name in ("common", "profile_step"):
        sys.modules.pop(name, None)
    return importlib.import_module("common")


def test_phase_timer_counts_exclusive_time_and_restores(common, monkeypatch):
    import types

    clock = [0.0]  # a fake perf_counter: each call below takes a known time

    def tick(seconds):
        clock[0] += seconds

    monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    mod = types.SimpleNamespace(inner=lambda: tick(1.0), outer=None)
    mod.outer = lambda: (mod.inner(), tick(0.5), mod.inner())
    original_inner = mod.inner
    timer = common.PhaseTimer()
    timer.wrap(mod, "inner", "in")
    timer.wrap(mod, "outer", "out")
    mod.outer()
    assert timer.take() == {"in": 2.0, "out": 0.5}  # the outer phase keeps only its own time
    timer.restore()
    assert mod.inner is original_inner and timer.take() == {}
    timer.wrap(mod, "inner", "in")
    timer.wrap(mod, "outer", "out", absorb=True)
    mod.outer()
    assert timer.take() == {"out": 2.5}  # absorb: the nested calls count as the outer phase


def test_every_masktrl_stage_is_found(common):
    """A renamed function would silently drop out of profile_step's table."""
    timer = common.PhaseTimer()
    common.wrap_masktrl_phases(timer)
    timer.restore()
    assert timer.missing == []


def test_profile_step_runs_and_shares_add_up(common, tmp_path):
    profile_step = importlib.import_module("profile_step")
    out = tmp_path / "p.json"
    profile_step.main([*TINY, "--steps", "3", "--full-run-steps", "20", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["steps_counted"] == 2
    assert abs(sum(r["shares"].values()) - 1.0) < 1e-6
    assert 0.0 < r["io_share"] < 1.0
    # the default decode loop is masktrl's fixed-batch loop (rollout.decode: auto), not transformers' generate
    assert r["phases_ms"]["rollout: masktrl decode loop"] > 0 and r["phases_ms"]["backward"] > 0


def test_runs_per_cpu_hour_pairs_each_preset_with_the_base_tree(common, tmp_path, monkeypatch):
    """The runs-per-CPU-hour table: every preset's variants beside the base tree's run when the base
    tree has the preset, alone when it does not; the ratio is base CPU over variant CPU."""
    rpch = importlib.import_module("runs_per_cpu_hour")
    base = tmp_path / "base"
    (base / "configs").mkdir(parents=True)
    (base / "configs" / "lab.yaml").write_text("{}\n")  # the base has the lab, not the agentic preset
    seconds = {"base": 300.0, "default": 250.0, "fast": 150.0}
    calls = []

    def fake_run(tree, preset, sets, steps, scratch, threads):
        variant = "base" if tree == base else ("fast" if sets else "default")
        calls.append((preset, variant, steps))
        phases = dict(zip(rpch.PHASES, (0.1, 0.2, 0.5, 0.2)))  # shares of the 1 s of wall time
        return {
            "cpu_s": seconds[variant],
            "wall_s": 1.0,
            "eval_before": 0.1,
            "eval_after": 0.2,
            "steps": steps,
            "phases_s": phases,
        }

    monkeypatch.setattr(rpch, "time_run", fake_run)
    out = rpch.main(
        ["--base", str(base), "--presets", "lab,agentic", "--steps", "3", "--json", str(tmp_path / "r.json")]
    )
    rows = {(r["preset"], r["variant"]): r for r in out["rows"]}
    assert set(rows) == {
        ("lab", "base"),
        ("lab", "this tree: default"),
        ("lab", "this tree: fast"),
        ("agentic", "this tree: default"),
        ("agentic", "this tree: fast"),
    }
    assert rows[("lab", "this tree: fast")]["ratio_vs_base"] == pytest.approx(2.0)
    assert rows[("lab", "this tree: default")]["runs_per_cpu_hour"] == pytest.approx(3600 / 250)
    assert rows[("agentic", "this tree: fast")]["ratio_vs_base"] is None
    # had the updates (half of the wall time) cost nothing: 300 / (150 x 0.5)
    assert rows[("lab", "this tree: fast")]["ratio_if_free"]["updates"] == pytest.approx(4.0)
    assert rows[("lab", "this tree: fast")]["ratio_if_free"]["warm start"] == pytest.approx(300 / 135)
    assert rows[("agentic", "this tree: fast")]["ratio_if_free"] is None
    assert all(steps == 3 for _, _, steps in calls)
    assert json.loads((tmp_path / "r.json").read_text())["steps"] == 3


def test_a_runs_phases_come_from_its_own_clocks(tmp_path):
    """The warm start from summary.json, the rollouts and updates from the steps' metrics rows (a row
    without step_time_s, e.g. an evaluation's, left out), the rest from the process's wall time."""
    sys.path.insert(0, str(BENCH))
    rpch = importlib.import_module("runs_per_cpu_hour")
    rows = [
        {"step": 1, "rollout_time_s": 0.5, "step_time_s": 2.0},
        {"step": 2, "rollout_time_s": 1.5, "step_time_s": 3.0, "eval": 0.4},
        {"eval_after": 0.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    phases = rpch.run_phases(tmp_path, {"warmstart": {"time_s": 4.0}}, 20.0)
    assert phases == {"warm start": 4.0, "rollouts": 2.0, "updates": 3.0, "the rest": 11.0}
    assert rpch.run_phases(tmp_path, {"warmstart": None}, 20.0)["warm start"] == 0.0  # a cached or absent one


@pytest.mark.slow  # about 18 s: keeps the fast suite under its 15 minutes (861 s on a 2-core AMD EPYC with it)
def test_runs_per_cpu_hour_commands_pass_the_pre_write_checks(tmp_path):
    """The fast variant's overrides are keys `masktrl train` accepts, on the lab and the agentic lab,
    and fast-fused's on the lab (checked by --dry-run, nothing run; the default variant adds no
    override)."""
    import subprocess

    sys.path.insert(0, str(BENCH))
    rpch = importlib.import_module("runs_per_cpu_hour")
    assert rpch.VARIANTS["default"] == []
    for preset, variant in (("lab", "fast"), ("agentic", "fast"), ("lab", "fast-fused")):
        command = rpch.train_command(preset, tmp_path / preset, rpch.VARIANTS[variant], 2) + ["--dry-run"]
        done = subprocess.run(command, cwd=rpch.ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert not (tmp_path / preset).exists()
    assert rpch.VARIANTS["fast-fused"] == [*rpch.VARIANTS["fast-packed"], "train.adamw=fused"]


def test_runs_per_cpu_hour_bad_input_and_a_failed_run_are_one_line_and_exit_2(tmp_path, capsys):
    sys.path.insert(0, str(BENCH))
    rpch = importlib.import_module("runs_per_cpu_hour")
    for argv, words in (
        (["--presets", "lab,nope"], "unknown preset 'nope'"),
        (["--variants", "turbo"], "unknown variant 'turbo'"),
        (["--base", str(tmp_path / "missing")], "not a folder"),
    ):
        with pytest.raises(SystemExit) as exc:
            rpch.main(argv)
        assert exc.value.code == 2 and words in capsys.readouterr().err
    (tmp_path / "runs").mkdir()
    with pytest.raises(SystemExit) as exc:  # a tree without the preset's config: masktrl refuses it
        rpch.time_run(tmp_path, "lab", [], 1, tmp_path / "runs")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "the lab run" in err and "configs/lab.yaml" in err and len(err.splitlines()) == 1


def _fake_train(work: dict, fail: str | None = None):
    """A stand-in for runs_per_cpu_hour's `masktrl train` command: a Python process that does
    ``work[variant]`` loop iterations of CPU work (``fail``: exits 1 at once; "sleep": waits), then
    writes the run's summary.json and one metrics row."""

    def command(preset, out, sets, steps, threads=1):
        variant = "fast" if sets else "base"
        if variant == fail:
            return [sys.executable, "-c", "import sys; print('boom: the run broke', file=sys.stderr); sys.exit(1)"]
        if work.get(variant) == "sleep":
            return [sys.executable, "-c", "import time; time.sleep(60)"]
        script = (
            "import json, pathlib, sys\n"
            f"x = 0\nfor i in range({work[variant]}): x += i * i\n"
            f"run = pathlib.Path({str(out)!r}) / 'run'\nrun.mkdir(parents=True)\n"
            "(run / 'summary.json').write_text(json.dumps({'eval_before': 0.1, 'eval_after': 0.2, 'steps': 1}))\n"
            "(run / 'metrics.jsonl').write_text(json.dumps({'rollout_time_s': 0.001, 'step_time_s': 0.002}) + '\\n')\n"
        )
        return [sys.executable, "-c", script]

    return command


def test_runs_per_cpu_hour_pairs_start_the_base_and_a_variant_together(tmp_path, monkeypatch):
    """--pairs: each round starts the base and the variant together; each run's CPU time is its own
    process's (the base does 30x the variant's work), and the ratio is the median of each pair's
    own ratio, not the ratio of the medians."""
    sys.path.insert(0, str(BENCH))
    rpch = importlib.import_module("runs_per_cpu_hour")
    base = tmp_path / "base"
    (base / "configs").mkdir(parents=True)
    (base / "configs" / "lab.yaml").write_text("{}\n")
    monkeypatch.setattr(rpch, "train_command", _fake_train({"base": 3_000_000, "fast": 100_000}))
    out = rpch.main(["--base", str(base), "--presets", "lab", "--variants", "fast", "--pairs", "--rounds", "3"])
    rows = {r["variant"]: r for r in out["rows"]}
    assert out["pairs"] is True and len(rows["base"]["runs"]) == 3 and len(rows["this tree: fast"]["runs"]) == 3
    bases = [r["cpu_s"] for r in rows["base"]["runs"]]
    fast = rows["this tree: fast"]["runs"]
    assert [r["paired_base_cpu_s"] for r in fast] == bases  # each variant run with the base run it ran beside
    assert all(r["cpu_s"] < b for r, b in zip(fast, bases))  # not the pair's sum
    ratios = sorted(b / r["cpu_s"] for r, b in zip(fast, bases))
    assert rows["this tree: fast"]["ratio_vs_base"] == pytest.approx(ratios[1])


def test_runs_per_cpu_hour_a_failed_run_of_a_pair_stops_the_other(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(BENCH))
    rpch = importlib.import_module("runs_per_cpu_hour")
    base = tmp_path / "base"
    (base / "configs").mkdir(parents=True)
    (base / "configs" / "lab.yaml").write_text("{}\n")
    started = []
    start = rpch.start_run
    monkeypatch.setattr(rpch, "start_run", lambda *a, **k: started.append(start(*a, **k)) or started[-1])
    monkeypatch.setattr(rpch, "train_command", _fake_train({"fast": "sleep"}, fail="base"))
    with pytest.raises(SystemExit) as exc:
        rpch.main(["--base", str(base), "--presets", "lab", "--variants", "fast", "--pairs"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "boom: the run broke" in err and len(err.strip().splitlines()) == 1
    assert len(started) == 2 and all(x.proc.poll() is not None for x in started)  # the sleeper was killed
    for argv in (["--rounds", "0"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as exc:
            rpch.main(argv)
        assert exc.value.code == 2 and "at least 1" in capsys.readouterr().err


def _vs_trl_blocks(cpu_ms: float) -> list[dict]:
    """Two blocks of vs_trl.py's shape, every step taking ``cpu_ms`` of CPU (and twice that of wall)."""
    step = {"step_s": [2 * cpu_ms / 1e3] * 3, "cpu_s": [cpu_ms / 1e3] * 3, "tokens": [100] * 3}
    return [{**step, "phases": [], "reward_mean": 0.5, "threads": [1]} for _ in range(2)]


@pytest.mark.parametrize("shape", ["default", "long"])
def test_vs_trl_goal_is_the_cpu_ratio_with_the_default_settings(common, shape):
    """vs_trl.py's goal is TRL's CPU time per step over masktrl's with the settings a user gets:
    the main side at the default shape, the side with nothing set at the long shape (its main side
    packs by a token budget, which is not a default); the other sides get their own CPU ratios."""
    vs = importlib.import_module("vs_trl")
    sides = {
        "masktrl": _vs_trl_blocks(100.0),
        "masktrl-defaults": _vs_trl_blocks(200.0),
        "masktrl-unpacked": _vs_trl_blocks(300.0),
        "masktrl-dropfinished": _vs_trl_blocks(80.0),
        "trl": _vs_trl_blocks(450.0),
    }
    out = vs.summarise(sides, type("Args", (), {"shape_run": shape})())
    assert out["cpu_time_ratio"] == pytest.approx(4.5)
    assert out["defaults_cpu_time_ratio"] == pytest.approx(2.25)
    assert out["unpacked_cpu_time_ratio"] == pytest.approx(1.5)
    assert out["dropfinished_cpu_time_ratio"] == pytest.approx(450 / 80)
    want = {"default": (4.5, 2.0, True), "long": (2.25, 2.5, False)}[shape]
    assert (out["default_cpu_time_ratio"], out["goal"], out["goal_met"]) == pytest.approx(want)
    assert out["default_side"] == vs.DEFAULT_SIDE[shape]


def test_gen_vs_base_floor_runs_the_batch_shape(common):
    """gen_vs_base.py's floor (the records' operations alone) runs as a child process on the lab's
    shape and counts the tokens a batch of that shape records: rows x new tokens per batch."""
    gen = importlib.import_module("gen_vs_base")
    assert gen.VARIANTS["floor"] is None  # not an engine: measure() runs FLOOR_CHILD for it
    out = gen.measure(gen.ROOT, 1, 2, None)  # 1 prompt x 8 samples, 2 timed batches
    assert out["rows"] == 8 and out["tokens"] == 2 * 8 * 5  # configs/lab.yaml: n = 8, max_new_tokens = 5
    assert out["cpu_s"] > 0 and out["threads"] == 1


def test_gen_vs_base_runs_its_children_with_the_threads_asked_for(common, capsys):
    """gen_vs_base.py's --threads reaches the child processes (the engine's and the floor's), which
    report the torch thread count they ran with; a count under 1 is refused with exit code 2."""
    gen = importlib.import_module("gen_vs_base")
    for kw in (None, gen.VARIANTS["fused"]):  # the floor, an engine
        out = gen.measure(gen.ROOT, 1, 1, kw, threads=2)
        assert out["threads"] == 2 and out["tokens"] == 8 * 5
    with pytest.raises(SystemExit) as exc:
        gen.main(["--threads", "0"])
    assert exc.value.code == 2
    assert "argument --threads: must be at least 1, got 0" in capsys.readouterr().err


COUNT_OPTIONS = {"--threads", "--rounds", "--reps", "--steps", "--gen-reps", "--gemm-rounds", "--gemm-reps"}
COUNT_OPTIONS |= {"--repeats"}


def test_count_type_refuses_what_is_not_a_whole_number_of_at_least_one(common):
    import argparse

    assert common.count("3") == 3
    for bad, msg in (("0", "must be at least 1, got 0"), ("-2", "got -2"), ("1.5", "whole number"), ("x", "'x'")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            common.count(bad)


def test_every_benchmark_reads_its_counts_with_the_count_type():
    """Threads, rounds, repetitions and steps below 1 gave a traceback deep in a run (an empty
    median, torch.set_num_threads(0)) or a table of nothing: every benchmark script that takes one
    reads it with common.count, so it is one line (common.Parser), exit 2."""
    import ast

    wrong = []
    for script in sorted(BENCH.glob("*.py")):
        if script.name == "gpu_check.py":  # runs alone on a device machine, without benchmarks/common.py
            continue
        for node in ast.walk(ast.parse(script.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
                continue
            names = {a.value for a in node.args if isinstance(a, ast.Constant)}
            kinds = {ast.unparse(k.value) for k in node.keywords if k.arg == "type"}
            if script.name == "bf16_step.py" and names == {"--steps"}:  # shape=N pairs, checked by the script
                continue
            if names & COUNT_OPTIONS and kinds != {"count"}:
                wrong.append(f"{script.name}: {sorted(names)} type={kinds}")
    assert not wrong, wrong


def test_a_count_below_one_is_one_line_and_exit_2_from_the_command_line():
    import subprocess

    out = subprocess.run(
        [sys.executable, str(BENCH / "runs_per_cpu_hour.py"), "--rounds", "0"], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "runs_per_cpu_hour.py: error: argument --rounds: must be at least 1, got 0"
    assert "Traceback" not in out.stderr


def test_compile_update_bad_input_and_a_failed_run_are_one_line_and_exit_2(common, capsys, monkeypatch):
    import subprocess

    sys.modules.pop("compile_update", None)
    cu = importlib.import_module("compile_update")
    for argv, words in (
        (["--variants", "turbo"], "unknown variant 'turbo'"),
        (["--steps", "1"], "at least 2"),
        (["--variants", "model-warm,model"], "list model before it"),
        (["--rounds", "0"], "at least 1"),
    ):
        with pytest.raises(SystemExit) as exc:
            cu.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and words in err and len(err.splitlines()) == 1

    def failing(*a, **k):
        raise subprocess.CalledProcessError(1, ["python"], output="", stderr="Traceback...\nRuntimeError: boom\n")

    monkeypatch.setattr(cu, "run_worker", failing)
    with pytest.raises(SystemExit) as exc:
        cu.main(["--variants", "eager-packed"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.strip() == "error: the eager-packed run failed: RuntimeError: boom"


def test_compile_update_compiles_the_parts_it_names_and_projects_a_run(common):
    """``compile_parts`` wraps exactly the modules a variant names (compilation itself waits for the
    first call, which this test does not make); ``summarise`` projects a lab run from the first
    update and the median of the later ones."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.modules.pop("compile_update", None)
    cu = importlib.import_module("compile_update")
    cfg = Qwen3Config(
        vocab_size=16, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=16, head_dim=4,
    )  # fmt: skip

    def compiled(module) -> bool:
        return module._compiled_call_impl is not None

    for what in ("norms+mlp", "layers", "model"):
        base = Qwen3ForCausalLM(cfg).model
        cu.compile_parts(base, what)
        layer = base.layers[0]
        assert compiled(base) == (what == "model")
        assert all(compiled(x) == (what == "layers") for x in base.layers)
        parts = (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm, base.norm)
        assert all(compiled(x) == (what == "norms+mlp") for x in parts)
        assert not compiled(layer.self_attn)

    # each variant's run: the lab with fast-packed's settings, its forward, AdamW kernels and minibatches
    from masktrl.config import load_config

    lab = load_config(cu.LAB, [])
    assert lab.train.minibatches == cu.LAB_MINIBATCHES
    for name, (packing, _, adamw, minibatches) in cu.VARIANTS.items():
        cfg = load_config(cu.LAB, cu.variant_overrides(name, 30, 1))
        assert (cfg.train.packing, cfg.train.adamw, cfg.train.steps) == (packing, adamw, 30)
        assert cfg.train.minibatches == minibatches
        assert cfg.train.logprob_chunk * minibatches == lab.train.logprob_chunk * lab.train.minibatches
        assert (cfg.rollout.decode, cfg.rollout.draw, cfg.rollout.mismatch) == ("fused", "inverse_cdf", "off")
        assert cfg.rollout.prompts_per_step == lab.rollout.prompts_per_step  # the same rows per step
    assert cu.VARIANTS["adamw-fused"] == (True, None, "fused", 8)
    assert cu.VARIANTS["minibatches-2"] == (True, None, "foreach", 2) and cu.VARIANTS["minibatches-1"][3] == 1
    assert not set(cu.ON_REQUEST) & set(cu.DEFAULT_VARIANTS.split(","))

    base_runs = [
        {"update_s": [1.0, 0.5, 0.4, 0.6], "eval_after": 0.3},
        {"update_s": [3.0, 0.7, 0.7], "eval_after": 0.3},
    ]
    base_row = cu.summarise("eager-packed", base_runs, None)  # medians over the rounds: 2.0 and 0.6
    assert base_row["first_update_s"] == 2.0 and base_row["later_update_s"] == pytest.approx(0.6)
    assert base_row["run_updates_s"] == pytest.approx(2.0 + 299 * 0.6) and base_row["eval_after"] == [0.3, 0.3]
    row = cu.summarise("model", [{"update_s": [60.0, 0.3, 0.3], "eval_after": 0.31}], base_row)
    assert row["run_updates_s"] == pytest.approx(60.0 + 299 * 0.3)
    assert row["ratio_vs_eager_packed"] == pytest.approx((2.0 + 299 * 0.6) / (60.0 + 299 * 0.3))
    assert row["later_ratio_vs_eager_packed"] == pytest.approx(2.0)


def test_adamw_kernels_times_both_kernels_on_the_lab_parameters(common, capsys, tmp_path):
    """adamw_kernels.py: the lab policy's trainable parameters; the two optimizers are the two
    kernels over their own copies with the same gradients (one step apart from float32 rounding);
    a short run writes each round's blocks; bad input is one line and exit 2."""
    import torch

    from masktrl.config import load_config

    sys.modules.pop("adamw_kernels", None)
    ak = importlib.import_module("adamw_kernels")
    params = ak.lab_parameters()
    m = load_config(ak.LAB).model
    assert params[0].shape == (2004, m.hidden_size)  # the embedding of the numbers tokenizer
    opts = ak.optimizers(params[:3])
    assert opts["fused"].param_groups[0]["fused"] is True and opts["foreach"].param_groups[0]["foreach"] is True
    a, b = (opts[k].param_groups[0]["params"] for k in ak.KERNELS)
    assert all(x is not y for x, y in zip(a, b))
    for x, y, p in zip(a, b, params):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-6)
        assert not torch.equal(x, p)  # both took their first step
    out = ak.main(["--rounds", "2", "--steps", "1", "--json", str(tmp_path / "a.json")])
    assert len(out["rounds"]) == 2 and set(out["rounds"][0]) == set(ak.KERNELS)
    assert out["run_updates"] == 2400 and out["parameters"] == sum(p.numel() for p in params)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        ak.main(["--rounds", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "at least 1" in err


def test_bf16_step_times_the_three_forms_of_the_lab_step_and_its_gemms(common, capsys, tmp_path):
    """bf16_step.py: the bfloat16 variant runs a bfloat16 copy of the float32 weights, autocast the
    float32 model itself; every GEMM of the step is recorded (7 linear layers a decoder layer, the
    forward and two GEMMs of the backward each, and the output layer's three), with its count; the
    sign test's threshold is the binomial one; bad input is one line and exit 2."""
    import torch

    sys.modules.pop("bf16_step", None)
    sys.modules.pop("roofline", None)
    bs = importlib.import_module("bf16_step")
    roofline = importlib.import_module("roofline")
    assert [bs.sign_test_threshold(n) for n in (5, 6, 8, 10, 20)] == [None, 6, 8, 9, 15]
    assert [bs.verdict(f, 10 - f, 9) for f in (10, 9, 8, 2, 1, 0)] == [
        "faster",
        "faster",
        "not told apart",
        "not told apart",
        "slower",
        "slower",
    ]
    assert bs.verdict(5, 0, None) == "not told apart"  # too few rounds for any verdict
    model, _, samples, dims, _ = roofline.build(
        "lab", roofline.shapes(["lab"])["lab"], torch.device("cpu"), torch.float32
    )
    before = [p.detach().clone() for p in model.parameters()]
    fns = bs.step_fns(model, samples)
    assert set(fns) == set(bs.VARIANTS)
    low = fns["bfloat16"].__defaults__[0]
    assert low is not model and all(p.dtype == torch.bfloat16 for p in low.parameters())
    assert all(torch.equal(p.float(), q.to(torch.bfloat16).float()) for p, q in zip(low.parameters(), before))
    assert fns["autocast"].__defaults__[0] is model and fns["autocast"].__defaults__[2] is True
    for f in fns.values():
        f()
    assert all(p.grad is None for p in model.parameters())  # each step drops its gradients
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # and takes no optimizer step
    gemms = bs.gemm_shapes(fns["float32"])
    assert sum(n for _, _, n in gemms) == 3 * 7 * dims["num_layers"] + 3
    vocab, hidden = model.get_output_embeddings().weight.shape
    tokens = sum(len(s.gen.response_ids) for s in samples)
    assert ("aten::addmm_", [[vocab, tokens], [tokens, hidden]], 1) in gemms  # the output layer's weight gradient
    for _, shapes, _ in gemms:
        bs.gemm_fn(shapes, torch.bfloat16)()  # every recorded pair of operands multiplies
    out = bs.main(["--shapes", "lab", "--rounds", "1", "--steps", "lab=1", "--gemm-rounds", "1", "--gemm-reps", "1"])
    (lab,) = out["shapes"]
    assert set(lab["variants"]) == set(bs.VARIANTS) and len(lab["rounds"]) == 1
    assert lab["variants"]["bfloat16"]["verdict"] == "not told apart"  # one round decides nothing
    assert set(lab["gemm_ms"]) == {"float32", "bfloat16"}
    capsys.readouterr()
    for bad, says in (
        (["--rounds", "0"], "at least 1"),
        (["--shapes", "huge"], "unknown shape"),
        (["--shapes", ","], "no shape"),
        (["--steps", "lab"], "shape=N"),
    ):
        with pytest.raises(SystemExit) as exc:
            bs.main(bad)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and says in err
