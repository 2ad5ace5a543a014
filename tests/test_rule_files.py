"""A rule of the user's own, loaded from a file (``--method path/to/rules.py:name``,
docs/METHODS.md "Writing your own rule"): the shipped example trains, its file's sha256 is
recorded and guards a resume, and bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from masktrl.config import load_config, resolve_method_spec, split_method
from masktrl.errors import ConfigError
from masktrl.methods import BoundMethod, TokenBatch, get_method, method_names
from tests.conftest import cli, write_tiny_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tanh_clip.py"
HEADER = "from dataclasses import dataclass\nfrom masktrl.methods import MethodParams, TokenLosses, register_method\n\n"
GOOD = (
    HEADER
    + """
@dataclass(frozen=True)
class P(MethodParams):
    scale: float = 1.0


@register_method("mine", P)
def mine(batch, adv, p, u):
    from masktrl.methods import unit_ratio_log
    return TokenLosses(-adv * p.scale * unit_ratio_log(batch).exp(), ~batch.valid, None, None, None, None)
"""
)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(tmp_path: Path, text: str, name: str = "rules.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- spec strings


def test_split_method_reads_a_file_spec_with_its_parameters():
    assert split_method("rules/x.py:soft") == ("rules/x.py:soft", [])
    assert split_method("rules/x.py:soft:tau=2:correction.kind=icepop") == (
        "rules/x.py:soft",
        ["method.tau=2", "method.correction.kind=icepop"],
    )
    assert split_method("pdm:tail=uniform") == ("pdm", ["method.tail=uniform"])
    assert split_method("grpo:correction.kind=c.py:clamp:correction.cap=2") == (
        "grpo",
        ["method.correction.kind=c.py:clamp", "method.correction.cap=2"],
    )


def test_run_stem_of_a_file_rule_is_its_name():
    from masktrl.recipes.sweep import run_stem

    assert run_stem("examples/tanh_clip.py:tanh_clip") == "tanh_clip"
    assert run_stem("examples/tanh_clip.py:tanh_clip:eps_high=0.5") == "tanh_clip-eps_high-0.5"
    assert run_stem("grpo:correction.kind=icepop") == "grpo-correction-kind-icepop"


def test_resolve_method_spec_gives_a_bound_method(tmp_path):
    bound = resolve_method_spec(f"{EXAMPLE}:tanh_clip:eps_high=0.5")
    assert isinstance(bound, BoundMethod) and bound.name == "tanh_clip"
    assert bound.params.eps_high == 0.5 and bound.params.eps_low == 0.2 and not bound.correction.active
    assert resolve_method_spec("grpo", {"kind": "icepop"}).correction.kind == "icepop"
    assert resolve_method_spec("pdm:tail=uniform").params.tail == "uniform"
    assert "tanh_clip" not in method_names()  # a file's rules stay out of the shipped names


def test_a_file_may_reuse_a_shipped_name_and_load_twice(tmp_path):
    path = _write(tmp_path, GOOD.replace('"mine"', '"grpo"'))
    first = resolve_method_spec(f"{path}:grpo")
    again = resolve_method_spec(f"{path}:grpo")
    assert first.method is again.method  # imported once per content
    assert get_method("grpo").params_cls is not first.method.params_cls
    path.write_text(GOOD.replace('"mine"', '"grpo"').replace("scale: float = 1.0", "scale: float = 2.0"))
    assert resolve_method_spec(f"{path}:grpo").params.scale == 2.0  # an edited file is loaded again


def test_config_records_the_rule_and_its_sha256(tmp_path):
    cfg = load_config(None, ["method.eps_low=0.1"], method=f"{EXAMPLE}:tanh_clip")
    assert cfg.method_name == "tanh_clip" and cfg.method.params.eps_low == 0.1
    block = cfg.to_dict()["method"]
    assert block == {"name": f"{EXAMPLE}:tanh_clip", "eps_low": 0.1, "sha256": _sha(EXAMPLE)}
    back = load_config(
        None, [f"method.sha256={'0' * 64}"], method=f"{EXAMPLE}:tanh_clip"
    )  # a request: the file as it is now
    assert back.to_dict()["method"]["sha256"] == _sha(EXAMPLE)
    assert cfg.resolved_method()["sha256"] == _sha(EXAMPLE) and cfg.resolved_method()["name"] == f"{EXAMPLE}:tanh_clip"


# --------------------------------------------------------------------------- the example's math


def test_example_gradient_is_autograd_of_its_value_form_in_float64():
    bound = resolve_method_spec(f"{EXAMPLE}:tanh_clip")
    eps_low, eps_high = bound.params.eps_low, bound.params.eps_high
    gen = torch.Generator().manual_seed(0)
    n, k = 40, 3
    mu = torch.randn(n, generator=gen, dtype=torch.float64) - 1.0
    mu[3] = float("-inf")  # an invalid token
    logp0 = mu + torch.randn(n, generator=gen, dtype=torch.float64) * 0.4
    logp0[4], logp0[5] = mu[5] + math.log(1e30), mu[5] + math.log(1e-30)  # extreme ratios
    mu[4] = mu[5]
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[7] = 0.0

    def batch(lp):
        return TokenBatch(
            logp=lp,
            behavior_logp=mu,
            sampled_ids=torch.arange(n),
            topk_ids=torch.zeros(n, k, dtype=torch.long),
            topk_behavior_logp=torch.full((n, k), -3.0, dtype=torch.float64),
            topk_logp=torch.full((n, k), -3.0, dtype=torch.float64),
            seq_ids=torch.arange(n) // 5,
        )

    lp = logp0.clone().requires_grad_()
    out = bound.token_losses(batch(lp), adv)
    out.loss.sum().backward()
    ref_lp = logp0.clone().requires_grad_()
    valid = mu > float("-inf")
    r = torch.exp(torch.where(valid, ref_lp - torch.where(valid, mu, torch.zeros_like(mu)), torch.zeros_like(mu)))
    e = torch.where(r.detach() >= 1, torch.full_like(r, eps_high), torch.full_like(r, eps_low))
    value = torch.where(valid, -adv * (1 + e * torch.tanh((r - 1) / e)), torch.zeros_like(r))
    value.sum().backward()
    finite = torch.isfinite(ref_lp.grad)
    assert bool(torch.isfinite(lp.grad).all()) and bool(torch.isfinite(out.loss).all())
    torch.testing.assert_close(out.loss.detach(), value.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(lp.grad[finite], ref_lp.grad[finite], atol=1e-12, rtol=1e-10)
    assert lp.grad[3] == 0 and out.loss[3] == 0 and lp.grad[7] == 0  # invalid token, A = 0
    assert lp.grad[4] == 0  # r = 1e30: the soft clip's gradient has decayed to 0, not inf * 0
    # near r = 1 it is importance-weighted policy gradient: value -A r, gradient -A r
    near = valid & ((r.detach() - 1).abs() < 1e-3)
    if bool(near.any()):
        torch.testing.assert_close(lp.grad[near], (-adv * r.detach())[near], atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------- bad input: one line, exit 2, nothing written

BROKEN = {
    "no such file": None,
    "registers no rule 'mine'": HEADER.replace("MethodParams, ", "") + "x = 1\n",
    "must take (batch, advantages, params, u)": GOOD.replace("def mine(batch, adv, p, u):", "def mine(batch, adv):"),
    "is not a dataclass": GOOD.replace("@dataclass(frozen=True)\nclass P(MethodParams):", "class P:"),
    "raised ZeroDivisionError on import": GOOD + "\n1 / 0\n",
    "raised ValueError on import": GOOD + '\nregister_method("mine", P)(mine)\n',  # registered twice in one file
}


@pytest.mark.parametrize("what", list(BROKEN))
def test_a_bad_rule_is_one_line_and_writes_nothing(tmp_path, cli_error, what):
    text = BROKEN[what]
    path = tmp_path / "rules.py" if text is None else _write(tmp_path, text)
    out = tmp_path / "out"
    line = cli_error("train", "--method", f"{path}:mine", "--out", out, "--set", "train.steps=1")
    assert what in line, line
    assert not out.exists()
    line = cli_error("sweep", "--methods", f"grpo,{path}:mine", "--seeds", "1", "--out", out)
    assert what in line, line
    assert not out.exists()
    with pytest.raises(ConfigError, match=what.replace("(", r"\(").replace(")", r"\)")):
        resolve_method_spec(f"{path}:mine")


def test_a_bad_parameter_of_a_file_rule_is_one_line(tmp_path, cli_error):
    out = tmp_path / "out"
    line = cli_error("train", "--method", f"{EXAMPLE}:tanh_clip", "--set", "method.eps_low=-1", "--out", out)
    assert "method.eps_low must be >=" in line
    line = cli_error("train", "--method", f"{EXAMPLE}:tanh_clip", "--set", "method.nope=1", "--out", out)
    assert "unknown parameter method.nope" in line
    assert not out.exists()


# --------------------------------------------------------------------------- runs


@pytest.mark.slow
def test_example_trains_two_steps_and_resume_guards_the_file(warm_out, tmp_path, cli_error):
    config = write_tiny_config(tmp_path / "tiny.yaml")
    rule = tmp_path / "tanh_clip.py"
    shutil.copy(EXAMPLE, rule)
    out = tmp_path / "out"
    shutil.copytree(warm_out, out)  # the tiny warm start, cached
    cli(
        "train",
        "--config",
        config,
        "--out",
        out,
        "--method",
        f"{rule}:tanh_clip",
        "--run",
        "mine",
        "--set",
        "train.steps=2",
    )
    root = out / "mine"
    recorded = yaml.safe_load((root / "run.yaml").read_text())["method"]
    assert recorded == {"name": f"{rule}:tanh_clip", "sha256": _sha(rule)}
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["stages"]["config"]["rule_file"] == {"path": str(rule), "sha256": _sha(rule)}
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)

    old = _sha(rule)
    rule.write_text(rule.read_text() + "\n# edited\n")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    for args in ((), ("--set", "train.steps=3")):
        line = cli_error("train", "--resume", "mine", "--out", out, *args)
        assert "changed since" in line and old[:12] in line, line
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before  # refused: the run as it was
    cli("train", "--resume", "mine", "--out", out, "--set", "train.steps=3", "--force")
    assert yaml.safe_load((root / "run.yaml").read_text())["method"]["sha256"] == _sha(rule)
    manifest = json.loads((root / "manifest.json").read_text())
    assert "method.sha256" in manifest["stages"]["config"]["forced_changes"]
    assert manifest["stages"]["config"]["rule_file"]["sha256"] == _sha(rule)


# --------------------------------------------------------------------------- a correction of your own

CORRECTION = '''import torch
from masktrl.methods import register_correction


@register_correction("clamp", keys={"cap": 2.0})
def clamp(log_rho, valid, seq_ids, adv, keys):
    """Token-level truncated IS, written outside masktrl: f = min(rho, cap)."""
    rho = log_rho.exp()
    return rho.clamp(max=keys["cap"]), torch.ones_like(valid)
'''


def test_a_correction_from_a_file_equals_the_shipped_one_it_transcribes(tmp_path):
    from masktrl.methods import correction_weights

    path = _write(tmp_path, CORRECTION, "corr.py")
    mine = resolve_method_spec("grpo", {"kind": f"{path}:clamp", "cap": 1.5})
    shipped = resolve_method_spec("grpo", {"kind": "token-tis", "cap": 1.5})
    assert mine.correction.resolved == {"cap": 1.5}
    gen = torch.Generator().manual_seed(1)
    mu = torch.randn(30, generator=gen, dtype=torch.float64) - 1
    mu[2] = float("-inf")
    ref = mu + torch.randn(30, generator=gen, dtype=torch.float64)
    seq, adv = torch.arange(30) // 6, torch.randn(30, generator=gen, dtype=torch.float64)
    for mode in ("bypass", "decoupled"):
        a = correction_weights(
            resolve_method_spec("grpo", {"kind": f"{path}:clamp", "cap": 1.5, "mode": mode}).correction,
            mu,
            ref,
            seq,
            adv,
        )
        b = correction_weights(
            resolve_method_spec("grpo", {"kind": "token-tis", "cap": 1.5, "mode": mode}).correction, mu, ref, seq, adv
        )
        for x, y in zip(a, b):
            assert torch.equal(x, y), mode
    assert shipped.correction.kind == "token-tis"


def test_a_correction_file_is_recorded_and_its_bad_input_is_one_line(tmp_path, cli_error):
    path = _write(tmp_path, CORRECTION, "corr.py")
    cfg = load_config(None, [f"method.correction.kind={path}:clamp"])
    assert cfg.to_dict()["method"] == {"name": "grpo", "correction": {"kind": f"{path}:clamp", "sha256": _sha(path)}}
    assert cfg.resolved_method()["correction"]["sha256"] == _sha(path)
    assert set(cfg.method.files) == {"method.correction.sha256"}
    out = tmp_path / "out"
    for kind, what in (
        (f"{tmp_path}/none.py:clamp", "no such file"),
        (f"{path}:other", "registers no correction 'other'"),
    ):
        line = cli_error("train", "--set", f"method.correction.kind={kind}", "--out", out)
        assert what in line, line
    line = cli_error("sweep", "--methods", f"grpo:correction.kind={path}:other", "--seeds", "1", "--out", out)
    assert "registers no correction 'other'" in line, line
    line = cli_error(
        "train", "--set", f"method.correction.kind={path}:clamp", "--set", "method.correction.lo=0.5", "--out", out
    )
    assert "method.correction.lo does not apply" in line, line
    bad = _write(
        tmp_path, CORRECTION.replace("def clamp(log_rho, valid, seq_ids, adv, keys):", "def clamp(log_rho):"), "bad.py"
    )
    line = cli_error("train", "--set", f"method.correction.kind={bad}:clamp", "--out", out)
    assert "must take (log_rho, valid, seq_ids, advantages, keys)" in line, line
    assert not out.exists()


@pytest.mark.slow
def test_sweep_compare_and_rollouts_from_take_a_file_rule(warm_out, tmp_path, cli_error):
    """From file to sweep to compare (docs/METHODS.md "Writing your own rule"): the sweep trains the
    rule beside grpo and prints the compare table; ``analyze compare`` reads its runs; another
    run trains the rule on the sweep's stored batches; an edited file is refused by the sweep."""
    config = write_tiny_config(tmp_path / "tiny.yaml", {"train": {"steps": 2}})
    rule = tmp_path / "tanh_clip.py"
    shutil.copy(EXAMPLE, rule)
    out = tmp_path / "out"
    shutil.copytree(warm_out, out)
    spec = f"{rule}:tanh_clip"
    result = cli(
        "sweep", "--methods", f"grpo,{spec},{spec}:eps_high=0.5", "--seeds", "1", "--config", config, "--out", out
    )
    assert "tanh_clip" in result.output and "grpo" in result.output
    for name in ("tanh_clip-seed0", "tanh_clip-eps_high-0.5-seed0"):
        assert json.loads((out / name / "summary.json").read_text())["method"] == "tanh_clip"
    table = json.loads((out / "analysis" / "compare.json").read_text())
    assert table["baseline"] == "grpo" and len(table["methods"]) == 3
    result = cli("analyze", "compare", "grpo-seed0", "tanh_clip-seed0", "--out", out, "--output", tmp_path / "cmp")
    assert "tanh_clip" in result.output
    cli(
        "train",
        "--config",
        config,
        "--out",
        out,
        "--method",
        spec,
        "--rollouts-from",
        "grpo-seed0",
        "--run",
        "replayed",
    )
    assert len((out / "replayed" / "metrics.jsonl").read_text().splitlines()) == 2
    rule.write_text(rule.read_text() + "\n# edited\n")
    line = cli_error("sweep", "--methods", f"grpo,{spec}", "--seeds", "1", "--config", config, "--out", out)
    assert "method.sha256" in line, line


def test_the_replay_analyses_take_a_file_rule():
    from masktrl.analysis.step_replay import update_choice

    cfg = load_config(None, ["method.eps_high=0.4"], method=f"{EXAMPLE}:tanh_clip")
    run = update_choice("run", cfg)
    assert run.method == f"{EXAMPLE}:tanh_clip" and run.params.eps_high == 0.4
    other = update_choice(f"{EXAMPLE}:tanh_clip", load_config(None))
    assert other.params.eps_high == 0.28 and other.describe()["params"]["eps_low"] == 0.2
