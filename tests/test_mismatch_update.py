"""rollout.mismatch: the mismatch statistics from the update's own forward (rl/mismatch.py
``UpdateLogp``) equal the separate forward's (``measure_mismatch``), and where each is used."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import masktrl.methods  # registers the methods
from masktrl.config import load_config
from masktrl.methods.registry import get_method
from masktrl.rl.mismatch import UpdateLogp, measure_mismatch, mismatch_source
from masktrl.rl.policy import PolicyForward
from masktrl.rl.update import Hooks, Learner, UpdateSettings, make_optimizer, policy_update
from masktrl.rollout.mismatch import KEYS
from tests.conftest import TIMING, masktrl, write_tiny_config
from tests.test_packing import make_samples


@pytest.fixture(scope="module")
def model():
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer("0123456789+=")
    return build_tiny_model(
        tok, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64), 0
    )


def _from_update(model, samples, grad_accum=1, name="grpo", minibatches=1, method=None, **settings):
    """The update's mismatch/* (``minibatches`` minibatches: then ``method`` computes pi_old
    first), checking that it trained."""
    m = copy.deepcopy(model)
    opt, sched = make_optimizer(m, load_config(None, ["train.lr=1e-2"]).train)
    s = UpdateSettings(
        minibatches=minibatches,
        grad_accum=grad_accum,
        grad_clip=1e9,
        logprob_chunk=7,
        temperature=0.9,
        horizon=20,
        method=method or get_method(name).bind(),
        **settings,
    )
    seen = []
    hook = UpdateLogp(then=lambda mb, idx, out, losses, u: seen.append(mb))
    hooks = Hooks(before=hook, old=hook.old)
    policy_update(Learner(PolicyForward(m), opt, sched), samples, s, step=1, hooks=hooks)
    assert seen and set(seen) == set(range(minibatches))  # the hook it wraps still runs, once per micro-batch
    stats = hook.stats(samples)
    assert not any(torch.equal(a, b) for a, b in zip(m.parameters(), model.parameters()))  # it did update
    return stats


def _separate(model, samples, pieces=1):
    return measure_mismatch(PolicyForward(model), model, None, samples, 0.9, 7, pieces)


@pytest.fixture
def threads(request):
    """torch's thread count for one test, restored after it (a training run in this process sets it too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("name", ["grpo", "sis", "gspo"])
def test_update_forward_gives_the_separate_forwards_numbers(model, name, threads):
    """One minibatch, one micro-batch (the default): the update forwards the whole batch in its
    seeded order before its step; put back in the batch's order, log pi and every statistic are
    the separate forward's over the same tokens (the invalid ones, log mu = -inf, left out by both):
    bit for bit with one thread; with two, the GEMM splits the shuffled batch otherwise and the
    numbers agree to float32 rounding (~5e-9 here)."""
    samples = make_samples(model.config.vocab_size, seed=3, groups=4, per_group=4)
    ref = _separate(model, samples)
    got = _from_update(model, samples, name=name)
    assert set(got) == set(KEYS) and got["mismatch/tokens"] == ref["mismatch/tokens"] > 0
    assert got["mismatch/logp_abs_mean"] > 0
    assert got == ref if threads == 1 else got == pytest.approx(ref, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("minibatches", [1, 2, 4])
def test_the_decoupled_pi_old_forward_gives_the_separate_forwards_numbers(model, minibatches):
    """method.correction.mode: decoupled computes pi_old of every minibatch before the first
    step, at the sampling weights: the mismatch/* reuse it (no separate forward) for any number
    of minibatches. The pi_old forward runs the update's seeded minibatches, the separate forward
    contiguous pieces, so each forward pads to another width: the same tokens, the numbers to
    float32 rounding (even one minibatch can differ in the last bits, as above with two threads)."""
    samples = make_samples(model.config.vocab_size, seed=7, groups=4, per_group=4)
    method = load_config(None, ["method.correction.mode=decoupled"]).method.bind()
    got = _from_update(model, samples, minibatches=minibatches, method=method)
    ref = _separate(model, samples, pieces=minibatches)
    assert set(got) == set(KEYS) and got["mismatch/tokens"] == ref["mismatch/tokens"] > 0
    for k in KEYS:
        assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), k


def test_truncated_responses_are_measured_under_mask_truncated(model):
    """rollout.mask_truncated drops a cut response from the loss, not from the measurement."""
    samples = make_samples(model.config.vocab_size, seed=4)
    for s in samples[::2]:
        s.gen.finished = False
    got, ref = _from_update(model, samples, mask_truncated=True), _separate(model, samples)
    assert got["mismatch/tokens"] == ref["mismatch/tokens"] and got == pytest.approx(ref, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize(
    "settings", [{"grad_accum": 2}, {"packing": True}, {"packing": True, "micro_batch_tokens": 40}]
)
def test_other_micro_batches_agree_to_rounding(model, settings):
    """With train.grad_accum > 1 or a token budget the update's micro-batches are other sets of
    sequences than the separate forward's contiguous pieces (another padding width per forward),
    and train.packing runs the padding-free forward: the same numbers to float32 rounding."""
    samples = make_samples(model.config.vocab_size, seed=5, groups=4, per_group=4)
    ref, got = _separate(model, samples, pieces=settings.get("grad_accum", 1)), _from_update(model, samples, **settings)
    assert got["mismatch/tokens"] == ref["mismatch/tokens"]
    for k in KEYS:
        assert got[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-7), k


def test_stats_need_every_sequence(model):
    samples = make_samples(model.config.vocab_size, seed=6)
    hook = UpdateLogp()
    with pytest.raises(RuntimeError, match="before its first step"):
        hook.stats(samples)
    assert hook.stats([]) == {}


def test_where_the_numbers_come_from():
    kw = {"staleness": 0, "minibatches": 1, "replay": False, "world": 1}
    assert mismatch_source("auto", **kw) == "update"
    assert mismatch_source("always", **kw) == "forward"
    assert mismatch_source("off", **kw) is None
    for change in ({"staleness": 2}, {"minibatches": 8}, {"world": 2}):
        assert (
            mismatch_source("auto", **{**kw, **change}) == "forward"
        )  # the update cannot give pi_old at the sampling weights
    # with the pi_old forward of a decoupled correction, any number of minibatches (not staleness, processes)
    assert mismatch_source("auto", **{**kw, "minibatches": 8, "old_forward": True}) == "update"
    assert mismatch_source("auto", **{**kw, "staleness": 2, "old_forward": True}) == "forward"
    assert mismatch_source("auto", **{**kw, "world": 2, "old_forward": True}) == "forward"
    assert mismatch_source("auto", **{**kw, "replay": True}) is None  # --rollouts-from: this policy did not sample it
    assert mismatch_source("always", **{**kw, "replay": True}) is None


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_runs_report_the_same_mismatch_either_way_and_none_when_off(tmp_path, warm_out):
    """A default run (one minibatch, staleness 0) with rollout.mismatch auto (from the update)
    and always (the separate forward): every metric equal; off: no mismatch/* and the same
    training (the measurement draws from no random stream)."""
    cfg = write_tiny_config(tmp_path / "c.yaml", {"train": {"steps": 2}})
    rows = {}
    for mode in ("auto", "always", "off"):
        run = f"mm-{mode}-{tmp_path.name}"
        r = masktrl(
            "train", "--config", cfg, "--out", warm_out, "--run", run, "--set", f"rollout.mismatch={mode}", cwd=tmp_path
        )
        assert r.returncode == 0, r.stderr
        rows[mode] = [
            {k: v for k, v in row.items() if k not in TIMING and not k.endswith("_s")} for row in _rows(warm_out / run)
        ]
    assert rows["auto"] == rows["always"]
    assert all(row["mismatch/tokens"] == row["tokens"] for row in rows["auto"])
    assert rows["off"] == [{k: v for k, v in row.items() if not k.startswith("mismatch/")} for row in rows["auto"]]


def test_bad_mode_is_one_line(cli_error, tmp_path):
    line = cli_error("train", "--set", "rollout.mismatch=sometimes", "--out", str(tmp_path))
    assert "rollout.mismatch must be one of auto, always, off" in line
    assert not any(tmp_path.glob("*/run.yaml"))
