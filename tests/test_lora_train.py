"""``model.lora`` in a run: adapter-only checkpoints naming the run's base, a SIGKILLed run
resumed bit for bit, zero-initialised adapters giving the first step of the full-model run, and
bad settings refused with one line before anything is written."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TIMING, masktrl, write_tiny_config

pytest.importorskip("peft")

LORA = {
    "seed": 2,
    "model": {"lora": {"rank": 4, "alpha": 8}},
    "train": {"steps": 3, "checkpoint_every": 1, "lr": 3.0e-3},
}


def metrics(root):
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    cfg = write_tiny_config(base / "c.yaml", LORA)
    r = masktrl("train", "--config", str(cfg), "--out", str(base / "out"), "--run", "ref")
    assert r.returncode == 0, r.stderr[-3000:]
    return base, cfg, base / "out" / "ref"


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_only(reference):
    _, _, root = reference
    ckpt = root / "checkpoints" / "000003"
    assert not (ckpt / "model.safetensors").exists()
    adapters = load_file(ckpt / "adapter_model.safetensors")
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == "../../base"
    assert (root / "base" / "model.safetensors").is_file()  # the warm-started base, saved once
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    numel = sum(v.numel() for v in adapters.values())
    assert len(state) == len(adapters) and sum(s["exp_avg"].numel() for s in state.values()) == numel
    # the adapters trained; B moved away from zero
    assert any(v.abs().sum() > 0 for k, v in adapters.items() if ".lora_B." in k)


def test_sigkill_then_resume_is_bit_identical(reference):
    base, cfg, ref = reference
    out = base / "out"
    r = masktrl(
        "train", "--config", str(cfg), "--out", str(out), "--run", "crash", env={"MASKTRL_CRASH_AT": "update:3"}
    )
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    r = masktrl("train", "--resume", "crash", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_file(ref / "checkpoints" / "000003" / "adapter_model.safetensors")
    b = load_file(out / "crash" / "checkpoints" / "000003" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert metrics(ref) == metrics(out / "crash")


def test_eval_and_rollout_load_the_adapter_checkpoint(reference, tmp_path):
    from masktrl.models.loading import load_model_and_tokenizer

    _, _, root = reference
    merged, _ = load_model_and_tokenizer(root / "checkpoints" / "000003")
    base, _ = load_model_and_tokenizer(root / "base")
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)  # the adapted layers only
    r = masktrl(
        "rollout",
        "--model",
        str(root),
        "--data",
        "synthetic",
        "--n",
        2,
        "--prompts",
        3,
        "--output",
        str(tmp_path / "r.parquet"),
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_zero_adapters_give_the_full_model_runs_first_step(reference):
    """Step 1's rollouts are sampled before any update, and its log pi (ppo_kl, entropy, the
    loss) with B = 0 is the base model's: identical to the same run without LoRA."""
    base, _, ref = reference
    plain = write_tiny_config(base / "plain.yaml", {**LORA, "model": {}})
    r = masktrl("train", "--config", str(plain), "--out", str(base / "out"), "--run", "plain", "--set", "train.steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    first_lora, first_plain = metrics(ref)[0], metrics(base / "out" / "plain")[0]
    for key in ("reward_mean", "response_len_mean", "ppo_kl", "entropy", "loss", "mask_frac"):
        assert first_lora[key] == first_plain[key], key
    assert first_lora["grad_norm"] != first_plain["grad_norm"]  # only the adapters' gradient is clipped and applied


@pytest.mark.parametrize(
    "setting, message",
    [
        ("model.lora.rank=0", "model.lora.rank must be a positive integer"),
        ("model.lora.rank=-4", "model.lora.rank must be a positive integer"),
        ("model.lora.target_modules=q_proj,query_key_value", "['query_key_value'] match no linear layer"),
    ],
)
def test_bad_lora_settings_are_one_line_and_write_nothing(tmp_path, setting, message):
    cfg = write_tiny_config(tmp_path / "c.yaml", {"model": {"lora": {"rank": 4}}})
    r = masktrl("train", "--config", str(cfg), "--out", str(tmp_path / "out"), "--run", "bad", "--set", setting)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "out" / "bad").exists()


def test_missing_peft_is_one_line_and_writes_nothing(tmp_path):
    cfg = write_tiny_config(tmp_path / "c.yaml", {"model": {"lora": {"rank": 4}}})
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['peft'] = None\n")  # import peft -> ImportError
    import os

    env = {"PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    r = masktrl("train", "--config", str(cfg), "--out", str(tmp_path / "out"), "--run", "bad", env=env)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "needs the peft package" in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "out" / "bad").exists()


def test_step_replay_holds_the_adapters_and_their_optimizer_state(reference):
    """The analyses that replay an update (analyze disagreement, estimators) load a LoRA
    checkpoint as training held it: base + adapters, unmerged, with the adapters' Adam state."""
    from masktrl.analysis.step_replay import load_replay
    from masktrl.models.lora import adapter_state_dict, has_lora

    _, _, root = reference
    replay = load_replay(root, step=3)
    assert has_lora(replay.model)
    saved = load_file(root / "checkpoints" / "000002" / "adapter_model.safetensors")
    assert len(adapter_state_dict(replay.model)) == len(saved)
    assert len(replay.optimizer.state) == len(saved)  # one Adam state per adapter matrix
    start = load_replay(root, step=1)  # step 0: the base with fresh zero adapters
    assert has_lora(start.model) and not start.optimizer.state


def test_the_reference_of_a_lora_policy_is_the_base_without_a_copy(tmp_path):
    from masktrl.models.lora import LoraSettings, apply_lora
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
    from masktrl.rl.policy import policy_token_batch
    from masktrl.rl.reference import AdapterReference, make_reference
    from masktrl.rollout.base import Sample, SamplingSettings
    from masktrl.rollout.hf import HFEngine

    tok = build_char_tokenizer("0123456789+=")
    shape = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    base = build_tiny_model(tok, shape, seed=0)
    model = apply_lora(build_tiny_model(tok, shape, seed=0), LoraSettings(rank=4), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.add_(0.1)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "3+4="]]
    gens = HFEngine(model, tok).generate(prompts, SamplingSettings(n=2, max_new_tokens=4, logprobs_k=3), seed=0)
    samples = [Sample("e", "", "", p, g, gen) for g, (p, grp) in enumerate(zip(prompts, gens)) for gen in grp]
    reference = make_reference(model, 1.0, 8)
    assert isinstance(reference, AdapterReference) and reference.model is model  # no copy
    model.train()
    got = reference(samples)
    assert model.training and all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())
    with torch.no_grad():
        want = policy_token_batch(base.eval(), samples, 1.0, 8).batch.logp
        adapted = policy_token_batch(model.eval(), samples, 1.0, 8).batch.logp
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (adapted - want).abs().max() > 1e-3


def test_lora_with_a_reference_kl_reports_kl_ref(tmp_path):
    cfg = write_tiny_config(tmp_path / "c.yaml", LORA)
    r = masktrl(
        "train",
        "--config",
        str(cfg),
        "--out",
        str(tmp_path / "out"),
        "--run",
        "kl",
        "--set",
        "method.kl_coef=0.01",
        "--set",
        "train.steps=2",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(tmp_path / "out" / "kl")
    assert len(rows) == 2 and all("kl_ref" in row for row in rows)
    assert abs(rows[0]["kl_ref"]) < 1e-5  # step 1: the adapters are still zero, the policy is its reference
