"""The lab preset (configs/lab.yaml) on a short run, made small by an overlay: its properties as
the run reports them (train.lab_stats), and rollout.staleness."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from masktrl.analysis.step_replay import behaviour_step
from masktrl.models.loading import load_model_and_tokenizer
from masktrl.rl.policy import policy_token_batch
from masktrl.runs.store import RunStore
from tests.conftest import TIMING, cli, masktrl

LAB = Path(__file__).resolve().parent.parent / "configs" / "lab.yaml"
SMALL = {  # the preset's task, tokenizer, embeddings, K and lab statistics; a smaller model and run
    "model": {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64},
    "task": {"n_test": 16, "options": {"answers": 1, "moduli": [2, 3]}},
    "warmstart": {"steps": 100, "batch_size": 32},
    "rollout": {"prompts_per_step": 6, "n": 4, "staleness": 1},
    "train": {"steps": 3, "checkpoint_every": 1, "lr": 1.0e-2, "minibatches": 2},
}


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    overlay = tmp / "small.yaml"
    overlay.write_text(yaml.safe_dump(SMALL))
    cli("train", "--config", LAB, "--config", overlay, "--out", tmp / "out", "--run", "r")
    return tmp / "out" / "r"


def _metrics(root):
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_lab_properties_are_reported(lab_run):
    rows = [json.loads(line) for line in (lab_run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((lab_run / "summary.json").read_text())
    lab = summary["lab_stats"]
    assert lab["vocab_size"] == 2004 >= 1000 and lab["topk"] == 20 and lab["delta"] == 0.15 and lab["steps"] == 3
    assert summary["eval_decoding"].startswith("sampled")
    # the top-20 list misses part of the behaviour's mass, and sampled tokens fall outside it
    assert lab["resid_p90_mean"] > 0.01 and lab["resid_ge_0.01_frac"]["mean"] > 0.2
    assert lab["outside_topk_frac_mean"] > 0
    assert all(0 <= r["lab/resid_p10"] <= r["lab/resid_p50"] <= r["lab/resid_p90"] <= 1 for r in rows)
    # step 1 trains on its own policy's batch: its first minibatch is on-policy, the second is
    # not (one update later); from step 2 on even the first minibatch is off-policy (staleness 1)
    assert rows[0]["lab/over_delta_first_mb"] == 0 < rows[0]["lab/over_delta"]
    assert sum(r["lab/over_delta_first_mb"] for r in rows[1:]) > 0
    assert sum(r["lab/disagree"] for r in rows) >= sum(r["lab/disagree_ratio_agg"] for r in rows) > 0
    assert all(r["lab/tails_differ"] > 0 for r in rows)  # aggregated and uniform tails give different Ddot signs
    assert lab["over_delta_per_step"]["max"] == max(r["lab/over_delta"] for r in rows)


def _logp_under(path, samples):
    model, _ = load_model_and_tokenizer(path)
    with torch.no_grad():
        return policy_token_batch(model, samples, temperature=1.0, chunk=1024).batch.logp


@pytest.mark.parametrize("step, behaviour", [(1, 0), (2, 0), (3, 1)])
def test_staleness_samples_each_batch_with_the_policy_one_step_older(lab_run, step, behaviour):
    """With rollout.staleness = 1, step S trains on a batch sampled by the policy after step S-2
    (the warm start for steps 1 and 2): the recorded behaviour log-probs are that policy's, as
    the analyses assume (``behaviour_step``), and not those of the policy the update starts from."""
    store = RunStore(lab_run)
    assert behaviour_step(store.config(), step) == behaviour
    samples, _ = store.read_rollouts(step)
    recorded = torch.tensor([x for s in samples for x in s.gen.logp])
    torch.testing.assert_close(_logp_under(store.policy_path(behaviour), samples), recorded, atol=2e-5, rtol=0)
    if step - 1 != behaviour:
        assert not torch.allclose(_logp_under(store.policy_path(step - 1), samples), recorded, atol=1e-3, rtol=0)


@pytest.mark.slow  # about 15 s: keeps the fast suite under its 15 minutes (861 s on a 2-core AMD EPYC with it)
def test_a_stale_run_killed_while_sampling_ahead_resumes_bit_identically(lab_run):
    """Killed while step 2 stores step 3's batch (sampled ahead): the resumed run restarts from
    checkpoint 1, reuses the stored batch 2 and samples batch 3 again with the same policy."""
    out = lab_run.parent
    args = ["--config", LAB, "--config", out.parent / "small.yaml", "--out", out]
    r = masktrl("train", *args, "--run", "killed", env={"MASKTRL_CRASH_AT": "rollout-write:3"})
    assert r.returncode == -9, r.stderr[-2000:]
    assert RunStore(out / "killed").checkpoints() == [1]
    r = masktrl("train", "--resume", "killed", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _metrics(out / "killed") == _metrics(lab_run)
    a, b = (load_file(root / "checkpoints" / "000003" / "model.safetensors") for root in (lab_run, out / "killed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
