"""warmstart.target_accuracy: the warm start stops at the first check that reaches the target;
the warm-start cache key (thread count, and unchanged for configs without the new keys)."""

import hashlib
import json

import pytest
import torch

from masktrl.config import HASH_UNLESS_SET, load_config
from masktrl.errors import ConfigError
from masktrl.rl import warmstart
from masktrl.rl.warmstart import prepare_policy, warmstart_key
from masktrl.tasks import make_task

EVERY = 20  # checks every 20 steps here (100 in a run), so the test stays short


@pytest.fixture
def checks_every(monkeypatch):
    monkeypatch.setattr(warmstart, "CHECK_EVERY", EVERY)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _policy(tiny_config, out, *sets):
    cfg = load_config(tiny_config, list(sets))
    return prepare_policy(cfg, make_task(cfg.task, cfg.model), out)


def test_stops_at_the_first_check_reaching_the_target_and_equals_the_shorter_warm_start(
    tiny_config, tmp_path, checks_every
):
    model, _, info = _policy(tiny_config, tmp_path, "warmstart.steps=200", "warmstart.target_accuracy=0.2")
    checks = info["train_accuracy_checks"]
    assert [s for s, _ in checks] == list(range(EVERY, info["steps_done"] + 1, EVERY))
    assert checks[-1][1] >= 0.2 > max(a for _, a in checks[:-1]) and info["steps_done"] < 200
    # the checks draw nothing from the training stream: it is exactly the fixed warm start of that many steps
    fixed, _, fixed_info = _policy(
        tiny_config, tmp_path, f"warmstart.steps={info['steps_done']}", "warmstart.target_accuracy=null"
    )
    assert fixed_info["steps_done"] == info["steps_done"] and fixed_info["train_accuracy_checks"] == []
    for (name, a), b in zip(model.state_dict().items(), fixed.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_unreached_target_runs_every_step(tiny_config, tmp_path, checks_every):
    _, _, info = _policy(tiny_config, tmp_path, "warmstart.steps=40", "warmstart.target_accuracy=1.0")
    assert info["steps_done"] == 40
    assert [s for s, _ in info["train_accuracy_checks"]] == [20, 40]
    assert all(0.0 <= a < 1.0 for _, a in info["train_accuracy_checks"])


def test_target_is_validated_and_part_of_the_cache_key_as_the_thread_count_is(tiny_config):
    with pytest.raises(ConfigError, match="warmstart.target_accuracy"):
        load_config(tiny_config, ["warmstart.target_accuracy=1.5"])
    a = load_config(tiny_config, ["warmstart.target_accuracy=0.5"])
    b = load_config(tiny_config, ["warmstart.target_accuracy=0.6"])
    c = load_config(tiny_config, ["warmstart.target_accuracy=0.5", "train.threads=2"])
    assert len({warmstart_key(a), warmstart_key(b), warmstart_key(c)}) == 3
    assert warmstart_key(c) == warmstart_key(a) + "-threads2"


def test_the_fingerprint_is_the_whole_config_and_the_warm_start_key_its_inputs():
    """Config.hash is the sha256 of the whole resolved config; the warm-start cache key hashes
    only its inputs (model, task, warmstart), so a key of another section changes the first only."""
    cfg = load_config(None, ["warmstart.target_accuracy=null"])
    whole = cfg.to_dict()
    for key in HASH_UNLESS_SET:  # unset, these keys are left out (the hashes of configs from before they existed stay)
        section, name = key.split(".")
        assert whole[section].pop(name) is None
    assert cfg.hash() == hashlib.sha256(json.dumps(whole, sort_keys=True, default=str).encode()).hexdigest()[:16]
    moe = load_config(None, ["warmstart.target_accuracy=null", "model.architecture=qwen3-moe", "model.num_experts=4"])
    assert (
        moe.to_dict()["model"]["num_experts"] == 4
        and moe.hash() != load_config(None, ["warmstart.target_accuracy=null", "model.architecture=qwen3-moe"]).hash()
    )  # set, it counts
    assert warmstart_key(cfg).endswith("-seed0")  # threads 1: no suffix
    lab = load_config(None, ["warmstart.target_accuracy=null", "rollout.staleness=2"])
    assert lab.hash() != cfg.hash() and lab.hash("model", "task", "warmstart") == cfg.hash("model", "task", "warmstart")


def test_weighted_target_loss_is_the_weighted_mean_and_with_unit_weights_transformers_loss():
    """weighted_target_loss against a float64 transcription (sum_t w_t CE_t / sum_t w_t over the
    labelled next-token positions), its gradient against the reference's, and with every weight 1
    the loss transformers' causal LM computes from the same labels."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from masktrl.rl.warmstart import weighted_target_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[:, :2] = -100  # the prompt
    labels[2, 5:] = -100  # padding
    weights = torch.rand(3, 7, generator=g) * 40
    loss = weighted_target_loss(logits, labels, weights)
    (grad,) = torch.autograd.grad(loss, logits)

    ref_logits = logits.detach().double().requires_grad_()
    num = den = torch.zeros((), dtype=torch.float64)
    for b in range(3):
        for t in range(6):  # position t predicts token t + 1
            if labels[b, t + 1] != -100:
                ce = -torch.log_softmax(ref_logits[b, t], -1)[labels[b, t + 1]]
                num = num + weights[b, t + 1].double() * ce
                den = den + weights[b, t + 1].double()
    ref = num / den
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(grad.double(), ref_grad, atol=1e-7)

    ones = weighted_target_loss(logits, labels, torch.ones(3, 7))
    assert ones.item() == pytest.approx(ForCausalLMLoss(logits, labels, vocab_size=11).item(), rel=1e-6)
