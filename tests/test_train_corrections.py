"""Off-policy corrections through the trainer (docs/METHODS.md §14): the decoupled mode's extra
forward, decoupled = bypass bit for bit with float32 rollouts and one minibatch, the per-step
metrics, corrections off-policy, and bad correction blocks from the command line."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import cli, masktrl, write_tiny_config


def _rows(root):
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def _run(warm_out, name, overlay, *sets):
    config = write_tiny_config(
        warm_out.parent / f"{name}.yaml", {"train": {"steps": 2, "checkpoint_every": 2}, **overlay}
    )
    cli("train", "--config", config, "--out", warm_out, "--run", name, *[a for s in sets for a in ("--set", s)])
    return warm_out / name


def _weights(root):
    return load_file(root / "checkpoints" / "000002" / "model.safetensors")


@pytest.mark.parametrize("kind", ["token-tis", pytest.param("icepop", marks=pytest.mark.slow)])
def test_decoupled_with_one_minibatch_is_bypass_bit_for_bit(warm_out, kind):
    """float32 rollouts, one minibatch: pi_old is the policy itself, so the three-policy update is
    the two-policy one to the bit (weights, losses, gradient norms, correction metrics)."""
    a = _run(warm_out, f"bypass-{kind}", {}, f"method.correction.kind={kind}")
    b = _run(warm_out, f"decoupled-{kind}", {}, f"method.correction.kind={kind}", "method.correction.mode=decoupled")
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = _rows(a), _rows(b)
    for x, y in zip(ra, rb, strict=True):
        for k in ("loss", "grad_norm", "corr_keep_frac", "corr_weight_mean", "reward_mean", "mask_frac"):
            assert x[k] == y[k], (k, x[k], y[k])
        assert y["ratio_max"] == 1.0 and y["ppo_kl"] == 0.0  # the trust region is against pi_old = pi
        assert x["ratio_max"] != 1.0  # ... while mu differs from pi in the last bits
        assert y["old_forward_s"] > 0.0 and x["old_forward_s"] > 0.0  # bypass takes its ratio on pi_old too
    plain = _run(warm_out, f"plain-{kind}", {})
    wp = _weights(plain)
    assert all(torch.equal(wa[k], wp[k]) for k in wa)  # nothing truncated or rejected at float32: plain grpo
    cur = _run(warm_out, f"current-{kind}", {}, f"method.correction.kind={kind}", "method.correction.ref=current")
    wc = _weights(cur)
    assert all(torch.equal(wa[k], wc[k]) for k in wa)  # one minibatch: pi_old is the policy's values
    assert all("old_forward_s" not in r for r in _rows(cur))  # ref=current: no extra forward


def test_corrections_off_policy_report_their_kept_fraction_and_weight(warm_out):
    """Two minibatches at a high learning rate: the second update sees pi != mu; a tight IcePop
    range rejects tokens there and token-TIS truncates."""
    off = {"train": {"steps": 2, "checkpoint_every": 2, "lr": 1.0e-2, "minibatches": 2}}
    ice = _run(
        warm_out,
        "off-icepop",
        off,
        "method.correction.kind=icepop",
        "method.correction.lo=0.98",
        "method.correction.hi=1.02",
        "method.correction.ref=current",
    )
    rows = _rows(ice)
    assert all(0.0 < r["corr_keep_frac"] < 1.0 for r in rows[1:]) and all(r["corr_keep_frac"] <= 1.0 for r in rows)
    anchored = _run(
        warm_out,
        "off-icepop-old",
        off,
        "method.correction.kind=icepop",
        "method.correction.lo=0.98",
        "method.correction.hi=1.02",
    )  # IcePop's own ratio pi_old / mu: 1 up to float32 rounding
    assert all(r["corr_keep_frac"] == 1.0 and r["old_forward_s"] > 0.0 for r in _rows(anchored))
    tis = _run(
        warm_out,
        "off-tis",
        off,
        "method.correction.kind=token-tis",
        "method.correction.cap=1.0",
        "method.correction.mode=decoupled",
    )
    rows = _rows(tis)
    assert all(r["corr_keep_frac"] == 1.0 and r["corr_weight_mean"] <= 1.0 for r in rows)
    run_yaml = (tis / "run.yaml").read_text()
    assert "correction" in run_yaml and "decoupled" in run_yaml


@pytest.mark.parametrize(
    "value, needle",
    [
        ("method.correction.kind=tis", "method.correction.kind"),
        ("method.correction.cap=0", "method.correction.cap"),
        ("method.correction.cap=-1", "method.correction.cap"),
    ],
)
def test_bad_correction_values_are_one_line_and_write_nothing(tmp_path, value, needle):
    sets = ["--set", "method.correction.kind=token-tis"] if "kind=" not in value else []
    r = masktrl("train", *sets, "--set", value, "--out", str(tmp_path), cwd=tmp_path)
    _one_line(r, needle, tmp_path)


@pytest.mark.parametrize(
    "sets, needle",
    [
        (
            ["method.correction.kind=icepop", "method.correction.lo=5", "method.correction.hi=0.5"],
            "method.correction.lo",
        ),
        (["method.correction.kind=icepop", "method.correction.cap=2"], "does not apply to kind=icepop"),
        (["method.correction.kind=token-tis", "method.correction.delta=0.1"], "method.correction.delta"),
        (["method.correction.mode=coupled"], "method.correction.mode"),
        (["method.correction.nosuch=1"], "method.correction.nosuch"),
    ],
)
def test_bad_correction_blocks_are_one_line_and_write_nothing(tmp_path, sets, needle):
    r = masktrl("train", *[a for s in sets for a in ("--set", s)], "--out", str(tmp_path), cwd=tmp_path)
    _one_line(r, needle, tmp_path)


def _one_line(r, needle, tmp_path):
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not any(tmp_path.iterdir()) or not any(tmp_path.glob("*/run.yaml"))


def test_a_sweep_spec_carries_a_correction():
    from masktrl.config import load_config, split_method
    from masktrl.recipes.sweep import parse_methods, run_stem

    spec = "grpo:correction.kind=token-tis:correction.mode=decoupled"
    assert parse_methods(f"grpo,{spec}") == ["grpo", spec]
    name, sets = split_method(spec)
    assert (name, sets) == ("grpo", ["method.correction.kind=token-tis", "method.correction.mode=decoupled"])
    assert run_stem(spec) == "grpo-correction-kind-token-tis-correction-mode-decoupled"
    cfg = load_config(None, sets, method=name)
    assert cfg.resolved_method()["correction"] == {
        "kind": "token-tis",
        "mode": "decoupled",
        "ref": "old",
        "cap": 2.0,
        "floor": None,
    }
    assert "correction" not in load_config(None, [], method="grpo").resolved_method()


def test_kept_denominator_does_not_depend_on_the_micro_batches(warm_out):
    """``denominator: kept`` (verl's modified_response_mask): the micro-batches' kept denominators are
    only known after their forward; the gradient rescale makes two micro-batches the one-batch update,
    and the update differs from the default denominator once tokens are rejected (under token-mean
    the two differ by one factor per minibatch, which the gradient clip and Adam take out)."""
    off = {"train": {"steps": 2, "checkpoint_every": 2, "lr": 1.0e-2, "minibatches": 2}}
    sets = (
        "method.correction.kind=icepop",
        "method.correction.lo=0.5",
        "method.correction.hi=2.0",
        "method.correction.ref=current",
        "method.correction.denominator=kept",
    )
    one = _run(warm_out, "kept-1", off, *sets)
    two = _run(warm_out, "kept-2", off, *sets, "train.grad_accum=2")
    w1, w2 = _weights(one), _weights(two)
    assert all(torch.allclose(w1[k], w2[k], rtol=1e-4, atol=1e-6) for k in w1)
    assert any(r["corr_keep_frac"] < 1.0 for r in _rows(one))
    default = _run(warm_out, "kept-all", off, *sets[:-1])  # seq-mean-token-mean: kept tokens re-weight the sequences
    wd = _weights(default)
    assert not all(torch.equal(w1[k], wd[k]) for k in w1)


def test_pi_old_uses_the_token_budget_micro_batches(warm_out):
    """``train.micro_batch_tokens``: the pi_old forward runs on the micro-batches the update uses, so
    decoupled mode (and a ratio on pi_old in bypass mode) pairs each token with its own pi_old."""
    a = _run(
        warm_out,
        "budget-dec",
        {},
        "method.correction.kind=token-tis",
        "method.correction.mode=decoupled",
        "train.micro_batch_tokens=200",
    )
    b = _run(warm_out, "whole-dec", {}, "method.correction.kind=token-tis", "method.correction.mode=decoupled")
    wa, wb = _weights(a), _weights(b)
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-7) for k in wa)
    assert all(r["ppo_kl"] == 0.0 for r in _rows(a))  # one minibatch: pi_old is the policy, token by token
