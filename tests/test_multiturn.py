"""Multi-turn rollouts with the transformers engine (masktrl/rollout/multiturn.py): the
environment's reply is appended as tokens (never re-tokenising the transcript), the policy's
tokens carry exactly the behaviour the model gives them in that transcript, the environment's
carry none, and the limits hold."""

from __future__ import annotations

import threading

import pytest
import torch

from masktrl.errors import ConfigError
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rl.policy import policy_token_batch
from masktrl.rollout.base import ENVIRONMENT, POLICY, Sample, SamplingSettings
from masktrl.rollout.hf import HFEngine
from masktrl.rollout.multiturn import generate_multi_turn, stop_cut
from masktrl.tasks.envs import EnvStats, Episode

STOP = "+"  # a call ends with '+'; the reply is '7=' and the episode goes on


class Adder:
    def reset(self, example):
        self.calls = 0
        self.limit = example["limit"]

    def step(self, call):
        self.calls += 1
        return "7=", self.calls >= self.limit


class Broken:
    def reset(self, example):
        pass

    def step(self, call):
        raise RuntimeError("down")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("0123456789+=")


@pytest.fixture(scope="module")
def model(tok):
    model = (
        build_tiny_model(
            tok,
            TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
            seed=1,
        )
        .double()
        .eval()
    )
    with torch.no_grad():  # make '+' likely, so episodes call the tool
        model.lm_head.weight[tok.convert_tokens_to_ids("+")] *= 4.0
    return model


def run(model, tok, drop_finished=False, env=Adder, max_turns=3, max_tokens=24, n=4, limit=2, seed=0, k=5):
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("12+3=", "4=", "99+")]
    stats = EnvStats()
    engine = HFEngine(model, tok, drop_finished=drop_finished)
    settings = SamplingSettings(n=n, max_new_tokens=8, logprobs_k=k)
    gens = generate_multi_turn(
        engine,
        tok,
        prompts,
        [{"limit": limit}] * 3,
        settings,
        seed,
        lambda: Episode(env, stats, timeout_s=5),
        stop=STOP,
        max_turns=max_turns,
        max_tokens=max_tokens,
    )
    return prompts, gens, stats


@pytest.mark.parametrize("drop_finished", [False, True])
def test_multi_turn_records(model, tok, drop_finished):
    prompts, gens, stats = run(model, tok, drop_finished)
    reply = tok.encode("7=", add_special_tokens=False)
    samples, multi = [], 0
    for i, group in enumerate(gens):
        assert len(group) == 4
        for g in group:
            T = len(g.response_ids)
            assert T <= 24 and len(g.source) == len(g.turn) == len(g.logp) == len(g.topk_ids) == T
            assert max(g.turn) < 3 and g.turn == sorted(g.turn)
            env = [t for t in range(T) if g.source[t] == ENVIRONMENT]
            for t in env:
                assert (
                    g.logp[t] == float("-inf") and set(g.topk_ids[t]) == {-1} and set(g.topk_logp[t]) == {float("-inf")}
                )
            # every environment span is the reply's own tokens (cut only by the token budget), right after a stop string
            spans, t = [], 0
            while t < T:
                if g.source[t] == ENVIRONMENT:
                    s = t
                    while t < T and g.source[t] == ENVIRONMENT:
                        t += 1
                    spans.append((s, t))
                else:
                    t += 1
            for s, e in spans:
                assert g.response_ids[s:e] == reply[: e - s]
                assert tok.decode(g.response_ids[:s], skip_special_tokens=True).endswith(STOP)
            multi += bool(spans)
            samples.append(Sample("e", "", "", prompts[i], i, g))
    assert multi > 0 and stats.calls > 0  # not vacuous
    # token-in, token-out: each policy token's recorded log mu is the model's, teacher-forced on the exact transcript
    out = policy_token_batch(model, samples, 1.0, 7)
    own = torch.tensor([s == POLICY for x in samples for s in x.gen.source])
    mu = torch.tensor([v for x in samples for v in x.gen.logp], dtype=torch.float64)
    torch.testing.assert_close(mu[own], out.batch.logp.detach()[own], atol=1e-5, rtol=0)
    assert not bool(out.batch.valid[~own].any())


def test_limits_and_a_failing_environment(model, tok):
    _, gens, stats = run(model, tok, max_turns=1)
    assert all(set(g.turn) <= {0} for group in gens for g in group)
    _, gens, stats = run(model, tok, max_tokens=5)
    assert all(len(g.response_ids) <= 5 for group in gens for g in group)
    _, gens, stats = run(model, tok, env=Broken)
    assert stats.errors > 0 and stats.calls == 0
    for group in gens:
        for g in group:
            assert ENVIRONMENT not in g.source  # the failed episode ended with the call, nothing appended


class Hangs:
    def reset(self, example):
        pass

    def step(self, call):
        threading.Event().wait(30)  # abandoned on its daemon thread after the timeout
        return "7=", False


class NotText:
    def reset(self, example):
        pass

    def step(self, call):
        return 7, False


class LongReply:
    def reset(self, example):
        pass

    def step(self, call):
        return "1234567890" * 5, False


class BadReset:
    def reset(self, example):
        raise KeyError("documents")

    def step(self, call):
        return "7=", False


def run_env(model, tok, env, timeout_s=5.0, max_tokens=24):
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("12+3=", "4=")]
    stats = EnvStats()
    gens = generate_multi_turn(
        HFEngine(model, tok),
        tok,
        prompts,
        [{}] * 2,
        SamplingSettings(n=4, max_new_tokens=8, logprobs_k=5),
        0,
        lambda: Episode(env, stats, timeout_s=timeout_s),
        stop=STOP,
        max_turns=3,
        max_tokens=max_tokens,
    )
    return [g for group in gens for g in group], stats


def test_an_environment_that_hangs_is_abandoned_and_counted(model, tok):
    gens, stats = run_env(model, tok, Hangs, timeout_s=0.2)
    calls = sum(STOP in tok.decode(g.response_ids) for g in gens)
    assert calls > 0 and stats.timeouts == calls and stats.calls == 0 and stats.errors == 0
    assert all(ENVIRONMENT not in g.source for g in gens)  # the episode ended with its call
    assert stats.take()["env_timeouts"] == calls


def test_a_reply_that_is_not_text_ends_the_episode_and_counts(model, tok):
    gens, stats = run_env(model, tok, NotText)
    calls = sum(STOP in tok.decode(g.response_ids) for g in gens)
    assert calls > 0 and stats.errors == calls and "expected (reply: str, done: bool)" in stats.last_error
    assert all(ENVIRONMENT not in g.source for g in gens)


def test_a_reply_longer_than_the_budget_is_cut_and_counted(model, tok):
    gens, stats = run_env(model, tok, LongReply, max_tokens=20)
    replied = [g for g in gens if ENVIRONMENT in g.source]
    assert replied and stats.truncated == len(replied) and stats.calls == len(replied)
    for g in replied:
        assert len(g.response_ids) == 20 and g.source[-1] == ENVIRONMENT and not g.finished  # out of tokens: cut
    assert stats.take()["env_truncated"] == len(replied)


def test_a_reset_that_fails_leaves_a_single_turn_response(model, tok):
    gens, stats = run_env(model, tok, BadReset)
    assert stats.errors == len(gens) and "KeyError" in stats.last_error
    assert all(set(g.source) == {POLICY} and set(g.turn) == {0} for g in gens)


def test_lists_wider_than_the_vocabulary(model, tok):
    _, gens, _ = run(model, tok, k=50)  # the engine returns min(K, V) entries: replies are padded to that width
    widths = {len(row) for group in gens for g in group for row in g.topk_ids}
    assert widths == {model.config.vocab_size}


def test_same_seed_same_rollouts(model, tok):
    a = run(model, tok, seed=3)[1]
    b = run(model, tok, seed=3)[1]
    assert [[g.response_ids for g in grp] for grp in a] == [[g.response_ids for g in grp] for grp in b]


def test_stop_cut(tok):
    ids = tok.encode("12+34+", add_special_tokens=False)
    dec = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    assert stop_cut(ids, dec, "+") == 3
    assert stop_cut(ids, dec, "4+") == 6
    assert stop_cut(ids, dec, "=") is None


@pytest.mark.parametrize(
    "sets, message",
    [
        (["task.env=masktrl.tasks.tools:Calculator", "rollout.top_k=5"], "samples the whole vocabulary"),
        (["task.max_turns=3"], "task.max_turns is an option of multi-turn tasks; set task.env"),
        (["task.env=masktrl.tasks.tools:Calculator", "rollout.top_p=0.9"], "samples the whole vocabulary"),
        (["task.env=Calculator"], "task.env must be path/to/file.py:Class or module:Class"),
        (["task.env=masktrl.tasks.tools:Calculator", "task.max_turns=0"], "task.max_turns must be > 0"),
    ],
)
def test_env_config_errors(sets, message):
    from masktrl.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope.py:Env", "error: task.env 'nope.py:Env': no such file nope.py"),
        ("noproto.py:E", "class E has no step method"),
    ],
)
def test_train_refuses_an_unusable_env_in_one_line(tmp_path, spec, message):
    import subprocess
    import sys

    (tmp_path / "noproto.py").write_text("class E:\n    def reset(self, ex):\n        pass\n")
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "masktrl.cli", "train", "--out", str(out), "--set", f"task.env={spec}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr[-2000:]
    assert not out.exists()  # nothing written


def test_a_stored_multi_turn_batch_replays_into_sis_and_pdm(model, tok, tmp_path):
    from masktrl.methods.registry import get_method
    from masktrl.rollout.storage import read_rollouts, write_rollouts

    prompts, gens, _ = run(model, tok)
    samples = [
        Sample("e", "", "", prompts[i], i, g, advantage=(j % 3) - 1.0)
        for i, group in enumerate(gens)
        for j, g in enumerate(group)
    ]
    path = tmp_path / "mt.parquet"
    write_rollouts(path, samples, {"step": 0})
    back, _ = read_rollouts(path, vocab_size=model.config.vocab_size)
    assert [s.gen.source for s in back] == [s.gen.source for s in samples]
    out = policy_token_batch(model, back, 1.0, 7)
    own = torch.tensor([s == POLICY for x in back for s in x.gen.source])
    for name in ("sis", "pdm"):
        bound = get_method(name).bind()
        u = (
            torch.rand(out.batch.n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            if bound.needs_u
            else None
        )
        losses = bound.token_losses(out.batch, out.advantages, u=u)
        loss = bound.aggregate(losses.loss, out.batch, horizon=20)
        (g,) = torch.autograd.grad(loss, out.batch.logp, retain_graph=True)
        assert float(g[~own].abs().sum()) == 0.0 and float(g[own].abs().sum()) > 0, name


class HugeReply(LongReply):
    def step(self, call):
        return "7=" * 3_000_000, False  # 6 MB: each episode's reply was tokenised whole, seconds apiece


def test_a_reply_of_megabytes_is_cut_before_it_is_tokenised(model, tok):
    """A tool printing megabytes made every call tokenise all of it before the cut: a 6 MB reply
    took seconds per episode (an agentic lab step with one such tool did not end in 10 minutes)."""
    gens, stats = run_env(model, tok, HugeReply, max_tokens=20)
    replied = [g for g in gens if ENVIRONMENT in g.source]
    assert replied and stats.truncated == len(replied)
    for g in replied:
        n_env = sum(s == ENVIRONMENT for s in g.source)
        assert len(g.response_ids) == 20 and tok.decode(g.response_ids[-n_env:]) == ("7=" * 20)[:n_env]


@pytest.mark.parametrize("reply", ["", "7=", "7=" * 5, "7=" * 64, "7=" * 65, "1" * 70, "7=" * 10_000])
@pytest.mark.parametrize("left", [0, 1, 3, 20])
def test_reply_tokens_keeps_the_full_texts_ids(tok, reply, left):
    """The ids kept and the cut flag equal tokenising the whole reply and cutting it to the budget."""
    from masktrl.rollout.multiturn import reply_tokens

    whole = tok.encode(reply, add_special_tokens=False) if reply else []
    ids, cut = reply_tokens(tok, reply, left)
    assert ids == whole[:left] and cut == (len(whole) > left)


class SpecialReply:
    def reset(self, example):
        pass

    def step(self, call):
        return "7</s>8", False  # the char tokenizer's EOS text inside a reply


def test_a_replys_special_token_text_is_that_token_and_does_not_end_the_episode(model, tok):
    """A reply is tokenised as the policy's tokenizer tokenises any text, special-token text
    included (so an environment can frame its reply in the chat template's markers, as verl's and
    SkyRL's chat-templated tool messages are): ``</s>`` in a reply is the EOS id, stored as an
    environment token, never trained; only the policy's own EOS or the environment's ``done`` ends
    the episode, so the policy goes on after it."""
    gens, _ = run_env(model, tok, SpecialReply)
    reply = tok.encode("7</s>8", add_special_tokens=False)
    assert reply[1] == tok.eos_token_id and len(reply) == 3
    segments = []  # each reply's environment tokens, in order
    for g in gens:
        for i, s in enumerate(g.source):
            if s == ENVIRONMENT and (i == 0 or g.source[i - 1] != ENVIRONMENT):
                segments.append(g.response_ids[i : i + 3])
    assert segments and all(seg == reply[: len(seg)] for seg in segments)  # the last may be cut to the budget
    assert any(tok.eos_token_id in seg for seg in segments)
    went_on = [g for g in gens if ENVIRONMENT in g.source and g.source[-1] == POLICY]
    assert went_on, "some episode should sample again after a reply holding the EOS text"
