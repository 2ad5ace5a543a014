"""The packed (padding-free) training forward computes what the padded one does, and the
token-budget batcher forms valid micro-batches (masktrl/models/packing.py).

Float64 throughout, so the only differences are summation order (~1e-13)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import masktrl.methods  # noqa: F401  (registers the methods)
from masktrl.methods.registry import get_method, method_names
from masktrl.models import packing
from masktrl.models.logprobs import token_logprobs_and_entropy
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rl import policy
from masktrl.rollout.base import Generation, Sample

TEMPERATURE, CHUNK, K = 0.9, 7, 4


@pytest.fixture(scope="module")
def model(float64_tiny_model):
    return float64_tiny_model


def make_samples(
    vocab: int, seed: int = 0, groups: int = 3, per_group: int = 3, lengths=(1, 2, 5, 11, 17)
) -> list[Sample]:
    """Ragged samples: prompts of 2-9 tokens shared by ``per_group`` samples each, responses of
    ``lengths``, behaviour log-probs near the model's (noisy), shuffled as after the minibatch
    permutation."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 10))]
        for _ in range(per_group):
            n = rng.choice(lengths)
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            topk = [rng.sample(range(vocab), K) for _ in range(n)]
            logp = [-rng.uniform(0.5, 4.0) for _ in range(n)]
            if n > 2:
                logp[1] = float("-inf")  # an invalid token
            gen = Generation(
                ids,
                logp,
                topk,
                [sorted((-rng.uniform(0.1, 5.0) for _ in range(K)), reverse=True) for _ in range(n)],
                True,
            )
            out.append(Sample(f"e{g}", "", "", prompt, g, gen, reward=rng.random(), advantage=rng.uniform(-1, 1)))
    rng.shuffle(out)
    return out


def pack(samples, share: bool) -> packing.Packed:
    if share:
        prompts, group = policy._distinct_prompts(samples)
        return packing.pack_shared(prompts, group, [s.gen.response_ids for s in samples])
    return packing.pack_whole([s.prompt_ids for s in samples], [s.gen.response_ids for s in samples])


def packed_outputs(model, samples, share: bool) -> policy.PolicyOutputs:
    """``policy_token_batch``'s outputs with log pi from the packed forward."""
    with torch.no_grad():
        ref = policy.policy_token_batch(model, samples, TEMPERATURE, CHUNK, share=share)
    h = packing.packed_hidden(model.base_model, pack(samples, share))  # [N, H]
    ids = torch.cat([ref.batch.sampled_ids[:, None], ref.batch.topk_ids], dim=1)
    lp, ent = token_logprobs_and_entropy(
        h, model.get_output_embeddings().weight, ids, temperature=TEMPERATURE, chunk_size=CHUNK
    )
    batch = dataclasses.replace(ref.batch, logp=lp[:, 0], topk_logp=lp[:, 1:])
    return policy.PolicyOutputs(batch, ref.advantages, ent, shared_prompt=share)


@pytest.mark.parametrize("share", [False, True])
def test_packed_hidden_equals_padded(model, share):
    samples = make_samples(model.config.vocab_size)
    want = policy.response_hidden(model, samples) if not share else None
    if share:  # the padded shared-prompt forward
        inner = policy.PolicyForward(model)
        prompts, group = policy._distinct_prompts(samples)
        inputs = policy._shared_prompt_inputs(samples, prompts, group)
        with torch.no_grad():
            want = inner.hidden(policy.ForwardInputs(**inputs))
    with torch.no_grad():
        got = packing.packed_hidden(model.base_model, pack(samples, share))
    assert got.shape == want.shape == (sum(len(s.gen.response_ids) for s in samples), model.config.hidden_size)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert model.config._attn_implementation != packing.ATTENTION_NAME  # switched back


def test_packed_tokens_are_the_real_ones(model):
    samples = make_samples(model.config.vocab_size)
    real = sum(len(s.prompt_ids) + len(s.gen.response_ids) - 1 for s in samples)
    assert pack(samples, share=False).tokens == real
    distinct = {tuple(s.prompt_ids) for s in samples}
    assert pack(samples, share=True).tokens == sum(map(len, distinct)) + sum(
        len(s.gen.response_ids) - 1 for s in samples
    )


def test_shared_layout_is_one_call_of_the_base_model(model):
    """Prompts and responses run through the per-token layers together: one base-model call, no
    KV cache; a response segment's keys are its prompt's segment then its own."""
    samples = make_samples(model.config.vocab_size)
    prompts, group = policy._distinct_prompts(samples)
    layout = pack(samples, share=True)
    width = sum(map(len, prompts))
    assert layout.input_ids[0, :width].tolist() == [t for p in prompts for t in p]
    for b, (s, e) in enumerate(layout.segments.queries[len(prompts) :]):
        assert layout.segments.keys[len(prompts) + b] == (layout.segments.queries[group[b]], (s, e))
        assert layout.position_ids[0, s:e].tolist() == list(
            range(len(prompts[group[b]]), len(prompts[group[b]]) + e - s)
        )
    calls = []
    handle = model.base_model.register_forward_hook(
        lambda mod, args, kwargs, out: calls.append(kwargs), with_kwargs=True
    )
    try:
        with torch.no_grad():
            packing.packed_hidden(model.base_model, layout)
    finally:
        handle.remove()
    assert len(calls) == 1 and calls[0]["use_cache"] is False


NON_VACUOUS = {
    "trm": {"delta": 1e3}
}  # these behaviour log-probs are far from pi: TRM's default would mask every sequence


def _losses_and_grads(model, out, name, samples):
    method = get_method(name)
    params = method.make_params(**NON_VACUOUS.get(name, {}))
    n = out.batch.logp.shape[0]
    u = (
        torch.rand(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        if method.needs_u(params)
        else None
    )
    losses = method.token_losses(out.batch, out.advantages, params, u=u)
    loss = method.aggregate(params, losses.loss, out.batch, horizon=20)
    grads = torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)
    return losses, loss.detach(), grads


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("name", method_names())
def test_every_method_same_losses_and_gradients(model, name, share):
    samples = make_samples(model.config.vocab_size, seed=1)
    padded = policy.policy_token_batch(model, samples, TEMPERATURE, CHUNK, share=share)
    assert padded.shared_prompt == share
    packed = packed_outputs(model, samples, share)
    for field in ("logp", "topk_logp"):
        torch.testing.assert_close(getattr(packed.batch, field), getattr(padded.batch, field), atol=1e-12, rtol=0)
    torch.testing.assert_close(packed.entropy, padded.entropy, atol=1e-12, rtol=0)
    la, loss_a, ga = _losses_and_grads(model, padded, name, samples)
    lb, loss_b, gb = _losses_and_grads(model, packed, name, samples)
    torch.testing.assert_close(lb.loss, la.loss, atol=1e-12, rtol=0)
    assert torch.equal(lb.mask, la.mask)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-12, rtol=0)
    nonzero = 0
    for a, b in zip(ga, gb):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-11, rtol=1e-9)
            nonzero += bool(a.abs().sum() > 0)
    assert nonzero > 0  # the comparison is not vacuous


def test_single_token_responses_and_one_segment(model):
    samples = make_samples(model.config.vocab_size, seed=2, lengths=(1,))
    for share in (False, True):
        out = packed_outputs(model, samples, share)
        ref = policy.policy_token_batch(model, samples, TEMPERATURE, CHUNK, share=share)
        torch.testing.assert_close(out.batch.logp, ref.batch.logp, atol=1e-12, rtol=0)
    one = make_samples(model.config.vocab_size, seed=3, groups=1, per_group=1, lengths=(9,))
    torch.testing.assert_close(
        packed_outputs(model, one, False).batch.logp,
        policy.policy_token_batch(model, one, TEMPERATURE, CHUNK).batch.logp,
        atol=1e-12,
        rtol=0,
    )


def test_packed_forward_under_activation_checkpointing(model):
    from masktrl.models import checkpointing

    samples = make_samples(model.config.vocab_size, seed=4)
    model.train()
    want = [g for g in _losses_and_grads(model, packed_outputs(model, samples, True), "grpo", samples)[2]]
    checkpointing.enable(model)
    try:
        with pytest.raises(RuntimeError, match="inside segments_attention"):
            packed_outputs(model, samples, True)
        with packing.segments_attention(model.base_model):  # the backward replays the packed layers
            got = _losses_and_grads(model, packed_outputs(model, samples, True), "grpo", samples)[2]
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    for a, b in zip(want, got):
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-11, rtol=1e-9)


def test_segment_attention_matches_a_block_diagonal_mask():
    """The per-segment kernel against one dense sdpa call with an explicit block mask, GQA included."""
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 3, 6, 1, 4, 3]  # equal shapes share one batched call
    t = sum(lengths)
    q = torch.randn(1, 4, t, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, t, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, t, 8, generator=gen, dtype=torch.float64)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    got, _ = packing.segment_attention(None, q, k, v, None, packed_segments=packing.Segments.self_attending(lengths))
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-13, rtol=0)


def test_packing_unsupported_names_the_reason(model):
    assert packing.packing_unsupported(model) is None
    assert packing.packing_unsupported(model.base_model) is None

    class Plain(torch.nn.Module):
        config = model.config

    assert "attention interface" in packing.packing_unsupported(Plain())
    hybrid = model.config.__class__(
        **{
            **model.config.to_dict(),
            "layer_types": ["sliding_attention", "full_attention"],
            "num_hidden_layers": 2,
            "use_sliding_window": True,
            "sliding_window": 4,
        }
    )
    from transformers import Qwen3ForCausalLM

    assert "sliding_attention" in packing.packing_unsupported(Qwen3ForCausalLM(hybrid))


# --------------------------------------------------------------------------- token-budget batcher


def _check_batches(p, r, budget, keys, res):
    flat = sorted(i for b in res.batches for i in b)
    assert flat == list(range(len(p)))  # every sequence exactly once
    for b in res.batches:
        assert b == sorted(b) and b
        tokens = packing.batch_tokens(p, r, b, keys)
        if tokens > budget:
            assert len(b) == 1 and b[0] in res.oversized
    assert res.oversized == sorted(i for i in range(len(p)) if packing.sequence_tokens(p[i], r[i]) > budget)


@pytest.mark.parametrize("seed", range(40))
def test_budget_batches_never_exceed_the_budget_and_cover_everything(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 60)
    groups = rng.randrange(1, n + 1)
    keys = [rng.randrange(groups) for _ in range(n)]
    plen = {g: rng.randrange(1, 40) for g in range(groups)}
    p = [plen[k] for k in keys]
    r = [max(1, int(rng.lognormvariate(3, 1))) for _ in range(n)]
    budget = rng.choice([1, 8, 50, 200, 1000, 10**6])
    for share in (False, True):
        res = packing.token_budget_batches(p, r, budget, keys if share else None)
        _check_batches(p, r, budget, keys if share else None, res)
    if budget >= 10**6:
        assert len(packing.token_budget_batches(p, r, budget, keys).batches) == 1


def test_budget_grouping_is_length_aware_and_shares_prompts():
    # four long and four short sequences, budget of two long ones: longs pair up, shorts pair up
    p, r = [1] * 8, [101, 3, 101, 3, 101, 3, 101, 3]
    res = packing.token_budget_batches(p, r, 202)
    assert res.batches == [[0, 2], [4, 6], [1, 3, 5, 7]] and res.oversized == []
    # a shared prompt is counted once: 8 samples of a 50-token prompt with 10-token responses
    p, r, keys = [50] * 8, [11] * 8, [0] * 8
    assert packing.token_budget_batches(p, r, 50 + 8 * 10, keys).batches == [list(range(8))]
    assert len(packing.token_budget_batches(p, r, 50 + 8 * 10).batches) == 4  # unshared: 60 tokens each, two fit


def test_oversized_sequence_is_alone():
    res = packing.token_budget_batches([5, 5, 5], [10, 400, 10], 100)
    assert res.oversized == [1] and [1] in res.batches and sorted(map(len, res.batches)) == [1, 2]


def test_bad_budget():
    for bad in (0, -3, 2.5, None):
        with pytest.raises(ValueError, match="positive int"):
            packing.token_budget_batches([1], [1], bad)


def test_balance_splits_to_the_count():
    out = packing.balance([[0, 1, 2, 3], [4]], 4)
    assert len(out) == 4 and sorted(i for b in out for i in b) == [0, 1, 2, 3, 4] and all(out)
    with pytest.raises(ValueError):
        packing.balance([[0], [1]], 3)


@pytest.mark.parametrize(
    "architecture", ["llama", "qwen2", "phi3", "olmo2", "gpt-neox"]
)  # qwen3-moe: its expert kernel has no float64
def test_packed_equals_padded_for_the_other_full_attention_architectures(architecture):
    tok = build_char_tokenizer("0123456789+=")
    m = (
        build_tiny_model(
            tok,
            TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
            0,
            architecture=architecture,
        )
        .double()
        .eval()
    )
    assert packing.packing_unsupported(m) is None
    samples = make_samples(m.config.vocab_size, seed=11)
    for share in (False, True):
        got = packed_outputs(m, samples, share)
        want = policy.policy_token_batch(m, samples, TEMPERATURE, CHUNK, share=share)
        torch.testing.assert_close(got.batch.logp, want.batch.logp, atol=1e-11, rtol=0)
        torch.testing.assert_close(got.batch.topk_logp, want.batch.topk_logp, atol=1e-11, rtol=0)


@pytest.mark.parametrize("architecture", ["mistral", "gemma2", "gemma3"])
def test_sliding_window_architectures_are_refused(architecture):
    tok = build_char_tokenizer("0123456789+=")
    m = build_tiny_model(
        tok,
        TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
        0,
        architecture=architecture,
    )
    assert "sliding" in packing.packing_unsupported(m)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_shared_prompt_backward_is_repeatable_with_two_threads(layout):
    """The shared-prompt forwards' backward gives the same gradients run after run with two CPU
    threads. Each response's column 0 is its prompt's last hidden state, so the forward repeats
    that position once per sample; the backward of advanced indexing (``x[idx]``: ``index_put_``
    with accumulate) adds such repeats in a thread-dependent order (a packed lab run at
    ``train.threads=2`` was another run each time), ``index_select``'s backward in index order.
    Float32, hidden 128 and enough rows that the backward's accumulation is split across threads."""
    tok = build_char_tokenizer("0123456789+=")
    shape = TinyModelConfig(hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=256)
    model = build_tiny_model(tok, shape, seed=0).float()
    samples = make_samples(model.config.vocab_size, groups=32, per_group=16, lengths=(1, 2, 3))
    prompts, group = policy._distinct_prompts(samples)
    inner = policy.PolicyForward(model)
    rows = sum(len(s.gen.response_ids) for s in samples)
    weights = torch.randn(rows, shape.hidden_size, generator=torch.Generator().manual_seed(0))

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        if layout == "packed":
            h = packing.packed_hidden(model.base_model, pack(samples, share=True))
        else:
            h = inner.hidden(policy.ForwardInputs(**policy._shared_prompt_inputs(samples, prompts, group)))
        (h * weights).sum().backward()  # a different gradient for every row of h
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first = grads()
        for _ in range(8):
            assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    finally:
        torch.set_num_threads(threads)
