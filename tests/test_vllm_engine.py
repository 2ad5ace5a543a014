"""VLLMEngine against a transformers float32 recomputation (run in the vLLM venv).

    scripts/setup_vllm_venv.sh
    .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_engine.py -q -p no:cacheprovider

Everything here is marked ``vllm`` (deselected by default) and skips where vLLM is not
importable. The engine is built once per module on a tiny untied Qwen3 saved to a tmp dir.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch

from masktrl.errors import MasktrlError
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rollout.base import Generation, SamplingSettings
from masktrl.rollout.hf import HFEngine
from masktrl.rollout.vllm import VLLMEngine, position_topk, request_seeds

pytestmark = pytest.mark.vllm

CPU_ENV = {  # in-process engine, no compilation, 1 GiB KV cache: starts in seconds on 2 cores
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
TOL = 1e-4
SETTINGS = SamplingSettings(n=4, max_new_tokens=12, temperature=0.7, top_p=1.0, logprobs_k=5)
PROMPTS_TEXT = ["1+2=", "12*3=", "7-9=", "\\boxed{4"]
LONG_PROMPT_TEXT = "12+345*6-7=" * 14  # 154 tokens: more than one KV block (128 on CPU), so prefix-cached


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(tokenizer, float32 model, saved folder) for a tiny untied Qwen3."""
    tok = build_char_tokenizer("0123456789+-*= \\boxed{}")
    model = build_tiny_model(tok, TinyModelConfig(max_positions=256), seed=0).float().eval()
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    prompts = [tok.encode(t) for t in PROMPTS_TEXT]
    return SimpleNamespace(tok=tok, model=model, path=path, prompts=prompts, long_prompt=tok.encode(LONG_PROMPT_TEXT))


@pytest.fixture(scope="module")
def engine(tiny):
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in CPU_ENV.items():
            mp.setenv(key, value)
        yield VLLMEngine(str(tiny.path), tiny.tok, dtype="float32", enforce_eager=True, seed=0)


@torch.no_grad()
def recompute(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at every response position under ``model``: [T, V]."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    return torch.log_softmax(logits / temperature, dim=-1)


def max_error(model, prompts, gens, temperature: float) -> float:
    """Largest |vLLM - recomputed| over sampled logps and top-K logps, checking top-K ids."""
    worst = 0.0
    for prompt, group in zip(prompts, gens, strict=True):
        for g in group:
            ref = recompute(model, prompt, g.response_ids, temperature)  # [T, V]
            sampled = ref.gather(1, torch.tensor(g.response_ids)[:, None]).squeeze(1)
            ref_top = ref.topk(len(g.topk_ids[0]), dim=-1).values  # [T, K]
            worst = max(
                worst,
                (sampled - torch.tensor(g.logp)).abs().max().item(),
                (ref_top - torch.tensor(g.topk_logp)).abs().max().item(),  # sorted values: tie-proof
                (ref.gather(1, torch.tensor(g.topk_ids)) - torch.tensor(g.topk_logp)).abs().max().item(),
            )
    return worst


def assert_topk_ids_match(model, prompts, gens, temperature: float) -> None:
    """Top-K ids equal the reference's, except where the reference itself has a near-tie."""
    for prompt, group in zip(prompts, gens, strict=True):
        for g in group:
            ref = recompute(model, prompt, g.response_ids, temperature)
            k = len(g.topk_ids[0])
            vals, ids = ref.topk(k + 1, dim=-1)  # one extra to see a tie at the K-th place
            for t in range(len(g.response_ids)):
                gaps = (vals[t, :-1] - vals[t, 1:]).abs()
                for r in range(k):
                    tied = gaps[r] < TOL or (r > 0 and gaps[r - 1] < TOL)
                    if not tied:
                        assert g.topk_ids[t][r] == ids[t, r].item(), (t, r)


def test_generate_matches_transformers_float32(engine, tiny):
    gens = engine.generate(tiny.prompts, SETTINGS, seed=1)
    assert len(gens) == len(tiny.prompts) and all(len(group) == SETTINGS.n for group in gens)
    assert max_error(tiny.model, tiny.prompts, gens, SETTINGS.temperature) < TOL
    assert_topk_ids_match(tiny.model, tiny.prompts, gens, SETTINGS.temperature)
    for group in gens:
        for g in group:
            for row in g.topk_logp:
                assert row == sorted(row, reverse=True)
            for t, token in enumerate(g.response_ids):  # logp consistent with the list it came from
                if token in g.topk_ids[t]:
                    assert g.logp[t] == pytest.approx(g.topk_logp[t][g.topk_ids[t].index(token)], abs=1e-6)
                else:
                    assert g.logp[t] <= g.topk_logp[t][-1] + 1e-6


def test_temperature_is_applied(engine, tiny):
    """processed_logprobs: T = 1 and T = 0.7 record different distributions, each matching."""
    hot = SamplingSettings(n=2, max_new_tokens=6, temperature=1.0, logprobs_k=5)
    gens = engine.generate(tiny.prompts[:2], hot, seed=3)
    assert max_error(tiny.model, tiny.prompts[:2], gens, 1.0) < TOL
    assert max_error(tiny.model, tiny.prompts[:2], gens, 0.7) > 1e-2


def test_seeded_generation_is_reproducible(engine, tiny):
    a = engine.generate(tiny.prompts, SETTINGS, seed=5)
    b = engine.generate(tiny.prompts, SETTINGS, seed=5)
    c = engine.generate(tiny.prompts, SETTINGS, seed=6)
    ids = lambda gens: [[g.response_ids for g in group] for group in gens]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    assert len({tuple(g.response_ids) for g in a[0]}) > 1  # the n samples of a prompt differ


class _Echo:
    """A tool for the multi-turn test: every call (text ending in ``=``) is answered with a fixed
    reply; the second call ends the episode."""

    REPLY = "42 "

    def reset(self, example):
        self.calls = 0
        return True

    def step(self, call):
        self.calls += 1
        return self.REPLY, self.calls == 2


def test_multi_turn_rollout_token_in_token_out(engine, tiny):
    """A vLLM multi-turn rollout (rollout/multiturn.py): each turn stops at the first stop string,
    the environment's reply is appended as its own token ids, and every policy token's recorded
    log mu and top-K list are the float32 model's at the episode's exact token prefix
    (environment tokens included as context); environment tokens carry no record."""
    from masktrl.rollout.base import ENVIRONMENT, POLICY
    from masktrl.rollout.multiturn import generate_multi_turn, stop_cut

    tok, stop = tiny.tok, "="
    prompts = [tiny.prompts[i % len(tiny.prompts)] for i in range(8)]
    settings = SamplingSettings(n=4, max_new_tokens=16, temperature=1.0, logprobs_k=5)
    gens = generate_multi_turn(
        engine, tok, prompts, [{}] * len(prompts), settings, 11, _Echo, stop=stop, max_turns=3, max_tokens=48
    )
    reply_ids = tok.encode(_Echo.REPLY, add_special_tokens=False)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    replies = 0
    for prompt, group in zip(prompts, gens, strict=True):
        assert len(group) == settings.n
        for g in group:
            src, turn = g.source, g.turn
            assert len(src) == len(turn) == len(g.response_ids) == len(g.logp)
            ref = recompute(tiny.model, prompt, g.response_ids, settings.temperature)  # [T, V]
            t = 0
            while t < len(src):  # one span of one source and turn at a time
                end = t
                while end < len(src) and (src[end], turn[end]) == (src[t], turn[t]):
                    end += 1
                span = g.response_ids[t:end]
                if src[t] == ENVIRONMENT:
                    replies += 1
                    assert span == reply_ids[: len(span)]  # the reply's own ids, appended as they are
                    assert all(math.isinf(x) and x < 0 for x in g.logp[t:end])
                    assert all(i == -1 for row in g.topk_ids[t:end] for i in row)
                else:
                    assert src[t] == POLICY
                    cut = stop_cut(span, decode, stop)
                    assert cut in (None, len(span))  # vLLM stopped at the first stop string
                    if end < len(src):  # a reply follows: the turn ended in a tool call
                        assert cut == len(span)
                    want = ref[t:end].gather(1, torch.tensor(span)[:, None]).squeeze(1)
                    assert (want - torch.tensor(g.logp[t:end])).abs().max().item() < TOL
                    got = ref[t:end].gather(1, torch.tensor(g.topk_ids[t:end]))
                    assert (got - torch.tensor(g.topk_logp[t:end])).abs().max().item() < TOL
                t = end
            if g.finished:  # EOS, never a stop string, ended it
                assert g.response_ids[-1] == tok.eos_token_id or src[-1] == ENVIRONMENT
    assert replies >= 4  # the test exercises replies, not only single turns


def test_stop_string_ends_the_request(engine, tiny):
    """SamplingSettings.stop: vLLM ends a response at the first stop string (kept, not finished);
    without it the same seed samples past the string."""
    from dataclasses import replace

    from masktrl.rollout.multiturn import stop_cut

    decode = lambda ids: tiny.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    settings = SamplingSettings(n=4, max_new_tokens=16, temperature=1.0, logprobs_k=5)
    stopped = [g for group in engine.generate(tiny.prompts, replace(settings, stop=("=",)), 11) for g in group]
    free = [g for group in engine.generate(tiny.prompts, settings, 11) for g in group]
    cuts = [stop_cut(g.response_ids, decode, "=") for g in stopped]
    assert all(c in (None, len(g.response_ids)) for c, g in zip(cuts, stopped))
    assert any(c is not None and not g.finished for c, g in zip(cuts, stopped))
    assert any((c := stop_cut(g.response_ids, decode, "=")) is not None and c < len(g.response_ids) for g in free)


def test_sync_weights_after_optimizer_step(engine, tiny):
    old = tiny.model
    new = copy.deepcopy(old).train()
    opt = torch.optim.AdamW(new.parameters(), lr=1e-2)
    batch = torch.tensor([tiny.prompts[0] + tiny.prompts[1]])
    loss = new(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    new.eval()
    # the long prompt's first KV block is prefix-cached under the old weights: sync must drop it
    prompts = [tiny.prompts[0], tiny.long_prompt]
    assert max_error(old, prompts, engine.generate(prompts, SETTINGS, seed=7), SETTINGS.temperature) < TOL
    try:
        engine.sync_weights(new)
        gens = engine.generate(prompts, SETTINGS, seed=7)
        assert max_error(new, prompts, gens, SETTINGS.temperature) < TOL
        assert max_error(old, prompts, gens, SETTINGS.temperature) > 1e-3
    finally:
        engine.sync_weights(old)  # later tests (and this check) see the original weights again
    gens = engine.generate(prompts, SETTINGS, seed=7)
    assert max_error(old, prompts, gens, SETTINGS.temperature) < TOL


def test_sync_weights_of_a_lora_model_pushes_the_merged_weights(engine, tiny):
    pytest.importorskip("peft")
    from masktrl.models.lora import LoraSettings, apply_lora

    adapted = apply_lora(copy.deepcopy(tiny.model), LoraSettings(rank=4, alpha=8), seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    adapted.eval()
    try:
        engine.sync_weights(adapted)
        gens = engine.generate(tiny.prompts, SETTINGS, seed=3)
        assert max_error(adapted, tiny.prompts, gens, SETTINGS.temperature) < TOL
        assert max_error(tiny.model, tiny.prompts, gens, SETTINGS.temperature) > 1e-3
    finally:
        engine.sync_weights(tiny.model)


def test_output_schema_matches_hf_engine(engine, tiny):
    settings = SamplingSettings(n=3, max_new_tokens=10, temperature=1.0, logprobs_k=6)
    eos = tiny.tok.eos_token_id
    hf = HFEngine(tiny.model, tiny.tok).generate(tiny.prompts, settings, seed=0)
    vl = engine.generate(tiny.prompts, settings, seed=0)
    for gens in (hf, vl):
        assert len(gens) == len(tiny.prompts)
        for group in gens:
            assert len(group) == settings.n
            for g in group:
                assert type(g) is Generation
                assert [f.name for f in fields(g)] == [f.name for f in fields(Generation)]
                n_tok = len(g.response_ids)
                assert 1 <= n_tok <= settings.max_new_tokens
                assert len(g.logp) == len(g.topk_ids) == len(g.topk_logp) == n_tok
                assert all(len(r) == settings.logprobs_k for r in g.topk_ids + g.topk_logp)
                assert all(type(i) is int for i in g.response_ids + sum(g.topk_ids, []))
                assert all(type(x) is float for x in g.logp + sum(g.topk_logp, []))
                assert eos not in g.response_ids[:-1]
                assert g.finished == (g.response_ids[-1] == eos)
                if not g.finished:
                    assert n_tok == settings.max_new_tokens
    assert max_error(tiny.model, tiny.prompts, vl, 1.0) < TOL
    assert max_error(tiny.model, tiny.prompts, hf, 1.0) < TOL


def test_logprobs_k_above_max_is_one_clear_error(engine, tiny):
    with pytest.raises(MasktrlError, match="max_logprobs"):
        engine.generate(tiny.prompts[:1], SamplingSettings(n=1, logprobs_k=engine.max_logprobs + 1), seed=0)


def test_logprobs_k_above_vllm_default_with_max_logprobs_raised(tmp_path):
    """K = 30 (the SIS paper's setting; masktrl train passes max_logprobs = max(K, 20)) on a model
    whose vocabulary is larger than 30: every position has 30 genuine top-K entries, within TOL
    of transformers."""
    pytest.importorskip("vllm")
    tok = build_char_tokenizer("0123456789+-*= abcdefghijklmnopqrstuvwxyz")
    model = build_tiny_model(tok, TinyModelConfig(max_positions=128), seed=1).float().eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in CPU_ENV.items():
            mp.setenv(key, value)
        engine = VLLMEngine(str(tmp_path), tok, dtype="float32", enforce_eager=True, seed=0, max_logprobs=30)
        prompts = [tok.encode("12+3="), tok.encode("abc")]
        gens = engine.generate(prompts, SamplingSettings(n=2, max_new_tokens=6, temperature=1.0, logprobs_k=30), seed=0)
    assert all(len(row) == 30 and -1 not in row for group in gens for g in group for row in g.topk_ids)
    assert max_error(model, prompts, gens, 1.0) < TOL


def test_position_topk_excludes_extra_sampled_entry_and_pads():
    entry = lambda lp, rank: SimpleNamespace(logprob=lp, rank=rank)  # noqa: E731
    # sampled token 9 outside the top-2: vLLM lists it first, with its own rank
    lp, ids, lps = position_topk({9: entry(-5.0, 7), 4: entry(-1.0, 1), 2: entry(-2.0, 2)}, 9, 2)
    assert (lp, ids, lps) == (-5.0, [4, 2], [-1.0, -2.0])
    # sampled token inside the top-2: merged, listed in rank order
    lp, ids, lps = position_topk({2: entry(-2.0, 2), 4: entry(-1.0, 1)}, 2, 2)
    assert (lp, ids, lps) == (-2.0, [4, 2], [-1.0, -2.0])
    # fewer entries than K (tiny vocabulary): padded
    lp, ids, lps = position_topk({4: entry(-0.1, 1)}, 4, 3)
    assert ids == [4, -1, -1] and lps[0] == -0.1 and lps[1:] == [-math.inf, -math.inf]
    # K = 0: only the sampled log-probability
    assert position_topk({4: entry(-0.1, 1)}, 4, 0) == (-0.1, [], [])


def test_request_seeds_are_deterministic_and_spaced():
    a = request_seeds(3, 4, n=8)
    assert a == request_seeds(3, 4, n=8) and a != request_seeds(4, 4, n=8)
    assert [b - a[0] for b in a] == [0, 8, 16, 24]


def test_import_is_lazy_and_missing_vllm_is_one_line(monkeypatch):
    code = "import sys, masktrl.rollout.vllm; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(MasktrlError, match=r"vLLM is not installed: pip install 'masktrl\[vllm\]'"):
        VLLMEngine("unused", None)


def test_sleep_mode_on_cpu_is_one_clear_error(engine, tiny):
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        pytest.skip("this platform supports sleep mode")
    with pytest.raises(MasktrlError, match="sleep mode is not available"):
        VLLMEngine(str(tiny.path), tiny.tok, dtype="float32", enforce_eager=True, enable_sleep_mode=True)
