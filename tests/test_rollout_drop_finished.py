"""``rollout.drop_finished``: the transformers engine's own decode loop, in which a row that has
ended leaves the batch and the KV cache (masktrl/rollout/decode.py), records what the
``generate`` path records and samples from the distribution it records."""

import math

import pytest
import torch

from masktrl.config import load_config
from masktrl.errors import ConfigError
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rollout.base import SamplingSettings
from masktrl.rollout.hf import HFEngine

TEXTS = ["12+3=", "1+2=", "345+67=", "9=", "8", "77+1=", "5+5+5+5=", "2"]  # ragged: 1 to 8 tokens


def eos_prone_model(tok, seed=2, scale=2.0, dtype=torch.float64, sharp=1.0):
    """A random tiny model whose EOS logit is scaled up, so some responses end after 1-8 tokens
    and others run to the limit (``sharp``: all logits scaled, a less flat distribution)."""
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, intermediate_size=128), seed=seed).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= scale
        model.lm_head.weight *= sharp
    return model


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("0123456789+=")


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def both(model, tok, prompts, settings, seed=0, **engine):
    gen = HFEngine(model, tok, **engine).generate(prompts, settings, seed)
    drop = HFEngine(model, tok, drop_finished=True, **engine).generate(prompts, settings, seed)
    return gen, drop


def flat(groups):
    return [g for group in groups for g in group]


def assert_same_records(a, b, atol):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.response_ids == y.response_ids and x.finished == y.finished
        assert x.topk_ids == y.topk_ids
        torch.testing.assert_close(
            torch.tensor(y.logp, dtype=torch.float64), torch.tensor(x.logp, dtype=torch.float64), atol=atol, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(y.topk_logp, dtype=torch.float64),
            torch.tensor(x.topk_logp, dtype=torch.float64),
            atol=atol,
            rtol=0,
        )


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("penalty", [None, 1.5])
def test_greedy_equals_generate_on_ragged_prompts_with_early_eos(tok, prompts, n, penalty):
    """Same tokens, log mu and top-K lists as ``generate``: float64 model, prompts of 1-8 tokens
    (left padding), responses ending after 1, 2, 6 and 8 tokens beside ones cut at the limit;
    with a repetition penalty in the model's generation_config, a logits processor that reads
    each row's token history (so the rows' histories must follow the rows that stay)."""
    model = eos_prone_model(tok)
    model.generation_config.repetition_penalty = penalty
    s = SamplingSettings(n=n, max_new_tokens=10, greedy=True, logprobs_k=5)
    gen, drop = both(model, tok, prompts, s)
    lengths = [len(g.response_ids) for g in flat(gen)]
    assert min(lengths) == 1 and max(lengths) == 10 and len(set(lengths)) >= 4  # the batch shrinks several times
    assert any(g.finished for g in flat(gen)) and not all(g.finished for g in flat(gen))
    assert_same_records(flat(gen), flat(drop), atol=1e-6)


def test_greedy_equals_generate_in_float32_and_with_single_token_prompts(tok):
    model = eos_prone_model(tok, seed=1, scale=1.5, dtype=torch.float32)
    for texts, n in ((TEXTS, 2), (["8", "2", "5", "+"], 1)):  # the second: every prompt one token, no prefill
        s = SamplingSettings(n=n, max_new_tokens=10, greedy=True, logprobs_k=20)  # K > vocabulary: whole lists
        prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        gen, drop = both(model, tok, prompts, s)
        assert_same_records(flat(gen), flat(drop), atol=1e-5)
        assert len({len(g.response_ids) for g in flat(gen)}) > 1


def teacher_forced(model, prompt, gen, temperature, top_p=1.0):
    """log mu of every response position from one forward of prompt + response (no padding, no
    cache), float64, with the nucleus cut of transformers' TopPLogitsWarper when top_p < 1."""
    from transformers.generation.logits_process import TopPLogitsWarper

    ids = torch.tensor([prompt + gen.response_ids])
    scores = model(ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.log_softmax(scores, -1)


@pytest.mark.parametrize(
    "temperature, top_p, texts",
    [(1.0, 1.0, TEXTS), (0.7, 1.0, TEXTS), (1.3, 0.8, TEXTS), (1.0, 1.0, ["8", "2", "5", "+"])],
)
def test_sampled_records_are_the_distribution_sampled_from(tok, temperature, top_p, texts):
    """Every recorded log mu and top-K list equals a teacher-forced forward of the sampled
    sequence (so the cache and history of each row stayed that row's after others left), and
    every response ends at its first EOS or at max_new_tokens; ragged prompts, and prompts of
    one token (no prefill)."""
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    model = eos_prone_model(tok, seed=1, scale=1.5)
    k, max_new = 6, 9
    s = SamplingSettings(n=4, max_new_tokens=max_new, temperature=temperature, top_p=top_p, logprobs_k=k)
    out = HFEngine(model, tok, drop_finished=True).generate(prompts, s, seed=3)
    assert [len(g) for g in out] == [4] * len(prompts)
    eos, lengths = tok.eos_token_id, []
    for prompt, group in zip(prompts, out):
        for gen in group:
            T = len(gen.response_ids)
            lengths.append(T)
            assert len(gen.logp) == len(gen.topk_ids) == len(gen.topk_logp) == T and 1 <= T <= max_new
            assert eos not in gen.response_ids[:-1]
            assert gen.finished == (gen.response_ids[-1] == eos) and (gen.finished or T == max_new)
            ref = teacher_forced(model, prompt, gen, temperature, top_p)  # [T, V]
            want = ref.gather(1, torch.tensor(gen.response_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(gen.logp, dtype=torch.float64), want, atol=2e-6, rtol=0)
            assert all(math.isfinite(x) for x in gen.logp)  # a sampled token has mass
            top_lp, top_ids = ref.topk(k, -1)
            torch.testing.assert_close(torch.tensor(gen.topk_logp, dtype=torch.float64), top_lp, atol=2e-6, rtol=0)
            finite = torch.isfinite(top_lp)  # ids of zero-mass atoms (outside the nucleus) are in no order
            assert torch.equal(torch.tensor(gen.topk_ids)[finite], top_ids[finite])
    assert len(set(lengths)) >= 4 and max(lengths) == max_new and min(lengths) < max_new


@pytest.mark.parametrize("draw", ["multinomial", "inverse_cdf"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (1.3, 0.8)])
def test_a_seed_samples_the_same_tokens_whether_or_not_finished_rows_leave(tok, prompts, draw, temperature, top_p):
    """The random numbers are drawn for the whole batch and the rows still running use theirs
    (rollout/draw.py: ``draw_tokens``), so a seed gives every response the tokens a loop that
    keeps every row gives it: ``generate``'s with ``multinomial``, the fixed-batch loop's
    (``rollout.decode: fused``) with ``inverse_cdf``; the records agree up to the rounding of a
    smaller batch's GEMMs (float64 here)."""
    model = eos_prone_model(tok, seed=1, scale=1.5)
    s = SamplingSettings(n=4, max_new_tokens=9, temperature=temperature, top_p=top_p, logprobs_k=6)
    loop = {"decode": "fused"} if draw == "inverse_cdf" else {}
    for seed in (0, 1, 2):
        whole = flat(HFEngine(model, tok, draw=draw, **loop).generate(prompts, s, seed))
        drop = flat(HFEngine(model, tok, drop_finished=True, draw=draw).generate(prompts, s, seed))
        lengths = [len(g.response_ids) for g in drop]
        assert len(set(lengths)) >= 4 and min(lengths) < 4  # rows leave early and at several steps
        assert_same_records(whole, drop, atol=1e-12)


def test_same_seed_same_samples_and_global_rng_untouched(tok, prompts):
    engine = HFEngine(eos_prone_model(tok, seed=1, scale=1.5), tok, drop_finished=True)
    s = SamplingSettings(n=4, max_new_tokens=8, logprobs_k=5)
    state = torch.get_rng_state()
    a, b, c = (flat(engine.generate(prompts, s, seed=x)) for x in (5, 5, 6))
    assert torch.equal(state, torch.get_rng_state())
    assert [(g.response_ids, g.logp, g.topk_logp) for g in a] == [(g.response_ids, g.logp, g.topk_logp) for g in b]
    assert [g.response_ids for g in a] != [g.response_ids for g in c]


def hoeffding_eps(n: int, alarm: float, tests: int) -> float:
    """The deviation |empirical - p| that each of ``tests`` frequencies over ``n`` draws exceeds
    with probability at most ``alarm / tests`` (Hoeffding: P(|f - p| >= eps) <= 2 exp(-2 n eps^2)),
    so all of them together raise a false alarm with probability at most ``alarm``."""
    return math.sqrt(math.log(2 * tests / alarm) / (2 * n))


def test_sampled_frequencies_follow_the_recorded_distribution(tok):
    """20000 samples of one prompt at T = 0.7: the frequencies of the first token and, among the
    rows whose first token was the most frequent other than EOS, of the second token (sampled
    after the ~40 % of rows that drew EOS first have left the batch) lie within a Hoeffding bound
    of the recorded mu. False-alarm probability of the whole test <= 1e-6 (union over the
    2 x 15 frequencies); the bound is tight enough to tell T = 0.7 from T = 1 at the first
    token, which is asserted too."""
    model = eos_prone_model(tok, seed=0, scale=1.5, sharp=5.0)
    prompt = tok("12+3=", add_special_tokens=False)["input_ids"]
    N, V, T = 20000, len(tok), 0.7
    s = SamplingSettings(n=N, max_new_tokens=2, temperature=T, logprobs_k=V)
    (group,) = HFEngine(model, tok, batch_size=N, drop_finished=True).generate([prompt], s, seed=0)
    eos = tok.eos_token_id
    mu0 = torch.zeros(V, dtype=torch.float64)
    mu0[torch.tensor(group[0].topk_ids[0])] = torch.tensor(group[0].topk_logp[0], dtype=torch.float64).exp()
    first = torch.bincount(torch.tensor([g.response_ids[0] for g in group]), minlength=V).double()
    assert 0.05 < first[eos] / N < 0.95  # rows do leave after the first step
    eps0 = hoeffding_eps(N, alarm=5e-7, tests=V)
    assert (first / N - mu0).abs().max() < eps0
    a = int(first.masked_fill(torch.arange(V) == eos, -1).argmax())
    rows = [g for g in group if g.response_ids[0] == a]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + [a]])).logits[0, -2:].double()
    mu1 = torch.softmax(logits[1] / T, -1)
    second = torch.bincount(torch.tensor([g.response_ids[1] for g in rows]), minlength=V).double()
    eps1 = hoeffding_eps(len(rows), alarm=5e-7, tests=V)
    assert len(rows) > 2000 and (second / len(rows) - mu1).abs().max() < eps1
    # the power: sampling at T = 1 instead of 0.7 would be caught
    assert (torch.softmax(logits[0], -1) - mu0).abs().max() > 2 * eps0


def test_drop_finished_is_an_hf_option():
    assert load_config(None, []).rollout.drop_finished is False
    assert load_config(None, ["rollout.drop_finished=true"]).rollout.drop_finished is True
    with pytest.raises(ConfigError, match=r"rollout\.drop_finished is an option of the hf engine"):
        load_config(None, ["rollout.engine=vllm", "rollout.drop_finished=true"])


def test_drop_finished_with_vllm_exits_2_with_one_line_and_no_folder(tmp_path, cli_error):
    line = cli_error(
        "train", "--set", "rollout.engine=vllm", "--set", "rollout.drop_finished=true", "--out", tmp_path, "--run", "x"
    )
    assert "rollout.drop_finished is an option of the hf engine" in line and not (tmp_path / "x").exists()


def test_a_training_run_with_drop_finished_records_what_the_trainer_computes(tmp_path, warm_out):
    """A 2-step ``masktrl train --set rollout.drop_finished=true``: it runs, and the engine's log mu
    of every sampled token matches the trainer's log pi_old at the same weights (``mismatch/*``:
    float32 KV-cache decoding vs the training forward), as with ``generate``."""
    import json

    from tests.conftest import masktrl, write_tiny_config

    cfg = write_tiny_config(tmp_path / "c.yaml")
    r = masktrl(
        "train",
        "--config",
        cfg,
        "--out",
        warm_out,
        "--run",
        "drop",
        "--set",
        "rollout.drop_finished=true",
        "--set",
        "train.threads=1",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (warm_out / "drop" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2]
    assert all(x["mismatch/tokens"] == x["tokens"] > 0 for x in rows)
    assert max(x["mismatch/logp_abs_mean"] for x in rows) < 1e-5


def test_a_processor_whose_rows_the_loop_cannot_follow_is_refused_with_one_line(tok, prompts, monkeypatch):
    """A logits processor with per-row state and no ``batch_select_indices`` (here: one appended
    to what transformers builds, as a model's generation_config could) is refused before anything
    is generated; one that defines it is told the rows that stay."""
    import transformers.generation.utils as gen_utils

    from masktrl.errors import MasktrlError

    class Opaque:
        def __call__(self, input_ids, scores):
            return scores

    class Following(Opaque):
        seen = []

        def batch_select_indices(self, indices):
            self.seen.append(indices.tolist())

    orig = gen_utils.GenerationMixin._get_logits_processor

    def adding(extra):
        def patched(self, *args, **kwargs):
            procs = orig(self, *args, **kwargs)
            procs.append(extra())
            return procs

        return patched

    model = eos_prone_model(tok)
    s = SamplingSettings(n=2, max_new_tokens=10, greedy=True, logprobs_k=5)
    for extra in (Opaque, Following):
        monkeypatch.setattr(gen_utils.GenerationMixin, "_get_logits_processor", adding(extra))
        engine = HFEngine(model, tok, drop_finished=True)
        if extra is Opaque:
            with pytest.raises(
                MasktrlError, match="rollout.drop_finished cannot follow the rows of the logits processor Opaque"
            ):
                engine.generate(prompts, s, seed=0)
        else:
            out = flat(engine.generate(prompts, s, seed=0))
    lengths = [len(g.response_ids) for g in out]
    assert len(Following.seen) >= 3 and len(Following.seen[-1]) == sum(
        L == 10 for L in lengths
    )  # the rows left at the end


def test_shared_prefix_attention_equals_the_forward_as_rows_and_prompts_leave(tok, prompts):
    """models/prefix_attention.py: a prompt's keys held once for its samples give the logits of
    the lean step over the per-row cache (float64, left-padded prompts), through buffer growth,
    rows leaving and a prompt whose samples have all ended leaving with them."""
    from masktrl.models.leanstep import lean_step
    from masktrl.models.prefix_attention import shared_prefix
    from masktrl.rollout.decode import growing_cache, prefill_cache

    model = eos_prone_model(tok, seed=3)
    chosen = [prompts[0], prompts[2], prompts[3]]  # 5, 7 and 2 tokens
    width, n = max(map(len, chosen)), 3
    ids = torch.tensor([[0] * (width - len(p)) + p for p in chosen])
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chosen])
    shared = shared_prefix(model, prefill_cache(model, ids, att, 1), att, n, spare=2)  # spare 2: the buffers grow
    cache = growing_cache(prefill_cache(model, ids, att, n), spare=2)
    with torch.no_grad():
        fast, ref = lean_step(model, None, attend=shared.attend), lean_step(model, cache)
        mask = att.repeat_interleave(n, 0)
        positions = (mask.cumsum(1) - 1)[:, -1:]
        token = ids.repeat_interleave(n, 0)[:, -1:]
        gen = torch.Generator().manual_seed(0)
        for step in range(6):
            a, b = fast(token, positions, None), ref(token, positions, mask)
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
            token = torch.randint(3, 12, (token.shape[0], 1), generator=gen)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            positions = positions + 1
            if step in (1, 3):  # step 1: prompt 0's three samples and one of prompt 1's; step 3: one more
                keep = torch.tensor([4, 5, 6, 7, 8]) if step == 1 else torch.tensor([0, 2, 3, 4])
                shared.select(keep)
                cache.batch_select_indices(keep)
                token, mask, positions = token[keep], mask[keep], positions[keep]
        assert shared.bias.shape[0] == 2 and shared.prompt_of.tolist() == [0, 1, 1, 1]
