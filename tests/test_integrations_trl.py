"""masktrl's rules inside TRL (masktrl/integrations/trl.py, docs/ECOSYSTEM.md): the recorded top-K lists are
the sampling distribution's, the loss and gradient on a fixed batch are masktrl's own, a short TRL run with
pdm trains, and the five lines docs/ECOSYSTEM.md shows run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]')")

from datasets import Dataset  # noqa: E402
from transformers import LogitsProcessorList  # noqa: E402
from transformers.generation import GenerationConfig  # noqa: E402

from masktrl.errors import ConfigError  # noqa: E402
from masktrl.integrations.trl import MasktrlGRPOTrainer, TopKRecorder, sampling_warpers  # noqa: E402
from masktrl.methods import TokenBatch  # noqa: E402
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ALPHABET = "0123456789+= "
SMALL = TinyModelConfig(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=64
)


def tiny(seed=0):
    tok = build_char_tokenizer(ALPHABET)
    return build_tiny_model(tok, SMALL, seed), tok


def reward(completions, **kw):
    """1 per '7' in the completion: something a tiny model can learn."""
    return [float(c.count("7")) for c in completions]


def dataset(n=8):
    return Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(n)])


def config(tmp_path, **over):
    from trl import GRPOConfig

    base = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=5,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        beta=0.0,
        top_k=0,
    )
    base.update(over)
    return GRPOConfig(**base)


def trainer(tmp_path, method="grpo", n=8, logprobs_k=None, **over):
    """A MasktrlGRPOTrainer of ``method`` on the tiny model, ``n`` prompts, ``config(**over)``."""
    model, tok = tiny()
    k = {} if logprobs_k is None else {"logprobs_k": logprobs_k}
    return MasktrlGRPOTrainer(
        method=method,
        model=model,
        processing_class=tok,
        reward_funcs=reward,
        args=config(tmp_path, **over),
        train_dataset=dataset(n),
        **k,
    )


def test_recorded_lists_are_the_sampling_distribution():
    """TopKRecorder's lists equal the top-K of log_softmax(output_scores) (the processed scores transformers
    samples from) and its sampled log-probs the entry of the sampled token, with temperature and top-p on."""
    model, tok = tiny()
    gc = GenerationConfig(
        do_sample=True,
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        max_new_tokens=6,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    ids = tok(["1+2=", "3+3="], return_tensors="pt", padding=True)
    rec = TopKRecorder(5, sampling_warpers(gc))
    torch.manual_seed(3)
    out = model.generate(
        **ids,
        generation_config=gc,
        logits_processor=LogitsProcessorList([rec]),
        return_dict_in_generate=True,
        output_scores=True,
    )
    got = rec.finish(out.sequences)
    lp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # [B, T, V]
    values, want_ids = lp.topk(5, dim=-1)
    sampled = out.sequences[:, ids["input_ids"].shape[1] :]
    assert torch.equal(got["behavior_topk_ids"], want_ids)
    torch.testing.assert_close(got["behavior_topk_logp"], values)
    torch.testing.assert_close(got["behavior_logp"], lp.gather(-1, sampled.unsqueeze(-1)).squeeze(-1))


def fixed_inputs(trainer, tok, k):
    """A fixed TRL batch (the dict _compute_loss reads), its behaviour a perturbed copy of the model's."""
    gen = torch.Generator().manual_seed(1)
    b, p, t = 4, 3, 5
    prompt_ids = torch.randint(0, len(ALPHABET), (b, p), generator=gen)
    completion_ids = torch.randint(0, len(ALPHABET), (b, t), generator=gen)
    completion_mask = torch.ones(b, t, dtype=torch.long)
    completion_mask[1, 3:] = 0
    completion_mask[2, 1:] = 0
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.cat([prompt_ids, completion_ids], 1)).logits[:, p - 1 : -1]
    mu = torch.log_softmax(logits.float() + 0.5 * torch.randn(logits.shape, generator=gen), -1)
    values, topk_ids = mu.topk(k, dim=-1)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(b, p, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.25, -1.0]),
        "num_items_in_batch": completion_mask.sum(),
        "behavior_logp": mu.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1),
        "behavior_topk_ids": topk_ids,
        "behavior_topk_logp": values,
    }


def own_loss(method, model, inputs, horizon):
    """masktrl's own loss, token by token: its methods' token losses and aggregation on a TokenBatch built here."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    t = inputs["completion_ids"].shape[1]
    lp = torch.log_softmax(model(input_ids=ids).logits[:, -t - 1 : -1].float(), -1)
    rows = [(i, j) for i in range(ids.shape[0]) for j in range(t) if inputs["completion_mask"][i, j]]
    tk = torch.stack([inputs["behavior_topk_ids"][i, j] for i, j in rows])
    batch = TokenBatch(
        logp=torch.stack([lp[i, j, inputs["completion_ids"][i, j]] for i, j in rows]),
        behavior_logp=torch.stack([inputs["behavior_logp"][i, j] for i, j in rows]),
        sampled_ids=torch.stack([inputs["completion_ids"][i, j] for i, j in rows]),
        topk_ids=tk,
        topk_behavior_logp=torch.stack([inputs["behavior_topk_logp"][i, j] for i, j in rows]),
        topk_logp=torch.stack([lp[i, j].detach()[tk[n]] for n, (i, j) in enumerate(rows)]),
        seq_ids=torch.tensor([i for i, _ in rows]),
        vocab_size=lp.shape[-1],
        pi_sq_sum=torch.stack([lp[i, j].detach().exp().pow(2).sum() for i, j in rows]),
    )
    adv = torch.stack([inputs["advantages"][i] for i, _ in rows])
    out = method.token_losses(batch, adv)
    return method.aggregate(out.loss, batch, horizon=horizon), out.loss


@pytest.mark.parametrize("spec", ["pdm", "dppo:divergence=topk-tv", "grpo", "pdm:tail=exact"])
def test_fixed_batch_loss_and_gradient_equal_masktrl(tmp_path, spec):
    model, tok = tiny()
    trainer = MasktrlGRPOTrainer(
        method=spec,
        model=model,
        processing_class=tok,
        reward_funcs=reward,
        args=config(tmp_path),
        train_dataset=dataset(),
        logprobs_k=4,
    )
    inputs = fixed_inputs(trainer, tok, 4)
    trainer.model.train()
    got = trainer.masktrl_loss(trainer.model, inputs)
    grads = torch.autograd.grad(got.loss, list(trainer.model.parameters()), allow_unused=True)
    want, want_tokens = own_loss(trainer.masktrl_method, trainer.model, inputs, horizon=5)
    want_grads = torch.autograd.grad(want, list(trainer.model.parameters()), allow_unused=True)
    torch.testing.assert_close(got.token_loss, want_tokens, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.loss, want, rtol=1e-6, atol=1e-7)
    for g, w in zip(grads, want_grads):
        if w is None:
            assert g is None or not g.abs().any()
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert trainer.masktrl_needs_topk == (spec != "grpo")
    # TRL's compute_loss divides by its accumulation steps (1 here), as its grpo loss does
    torch.testing.assert_close(trainer.compute_loss(trainer.model, inputs), want, rtol=1e-6, atol=1e-7)


def test_short_trl_run_with_pdm_trains(tmp_path):
    model, tok = tiny()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = MasktrlGRPOTrainer(
        method="pdm",
        model=model,
        processing_class=tok,
        reward_funcs=reward,
        args=config(tmp_path),
        train_dataset=dataset(),
        logprobs_k=4,
    )
    seen = {}
    original = trainer._compute_loss

    def spy(m, inputs):
        seen.update({k: inputs[k] for k in ("behavior_logp", "behavior_topk_ids", "completion_mask")})
        loss = original(m, inputs)
        seen.setdefault("losses", []).append(loss.item())
        return loss

    trainer._compute_loss = spy
    trainer.train()
    assert all(torch.isfinite(torch.tensor(seen["losses"])))
    changed = sum(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))
    assert changed > 0
    mask = seen["completion_mask"].bool()
    assert torch.isfinite(seen["behavior_logp"][mask]).all() and (seen["behavior_logp"][mask] <= 0).all()
    assert seen["behavior_topk_ids"].shape[-1] == 4
    logged = [h for h in trainer.state.log_history if "masktrl/masked_frac" in h]
    assert logged and all(0.0 <= h["masktrl/masked_frac"] <= 1.0 for h in logged)


def test_correction_and_file_rule(tmp_path):
    """A correction that needs pi_old (one extra no-grad forward after generation) and a rule from a
    file run, with TRL's gradient accumulation and two iterations per generation (TRL splits and
    reuses the batch, lists included)."""
    model, tok = tiny()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = MasktrlGRPOTrainer(
        method=str(ROOT / "examples" / "tanh_clip.py") + ":tanh_clip",
        correction={"kind": "icepop"},
        model=model,
        processing_class=tok,
        reward_funcs=reward,
        args=config(tmp_path, max_steps=2, gradient_accumulation_steps=2, num_iterations=2),
        train_dataset=dataset(4),
        logprobs_k=3,
    )
    trainer.train()
    assert trainer.masktrl_method.correction.kind == "icepop"
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))


def test_bad_input_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        trainer(tmp_path, method="nope.py:x")
    with pytest.raises(ConfigError, match="logprobs_k"):
        trainer(tmp_path, method="pdm", logprobs_k=0)


def test_the_five_lines_in_the_docs_run_as_written(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "ECOSYSTEM.md").read_text()
    block = re.search(r"<!-- trl-five-lines -->\s*```python\n(.*?)```", text, re.S).group(1)
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert len(lines) == 5, lines
    model, tokenizer = tiny()
    monkeypatch.chdir(tmp_path)
    scope = {"model": model, "tokenizer": tokenizer, "reward": reward, "dataset": dataset()}
    exec(compile(block, "docs/ECOSYSTEM.md", "exec"), scope)
    assert scope["trainer"].state.global_step >= 1
