"""``compare_routing``: the fraction of tokens two copies of an MoE model route to different
top-k expert sets, checked against sets computed by hand from the routers' logits."""

import copy

import pytest
import torch

from masktrl.models.moe import compare_routing, top_k_experts
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

SHAPE = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)


@pytest.fixture(scope="module")
def moe():
    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, SHAPE, seed=0, architecture="qwen3-moe")
    ids = torch.randint(3, len(tok), (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    return model, ids, mask


def _router_inputs(model, ids, mask):
    """[layers][B*L, H] the hidden states each router sees, captured with hooks."""
    seen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, args, out: seen.append(args[0].reshape(-1, args[0].shape[-1])))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    return seen


def test_top_k_experts_are_the_routers_top_sets(moe):
    model, ids, mask = moe
    got = top_k_experts(model, ids, mask)  # [layers, N, 2]
    keep = mask.reshape(-1).bool()
    assert got.shape == (2, int(mask.sum()), 2)
    for i, (layer, h) in enumerate(zip(model.model.layers, _router_inputs(model, ids, mask))):
        logits = h.double() @ layer.mlp.gate.weight.double().t()  # [B*L, E]
        want = logits.topk(2, dim=-1).indices.sort(-1).values[keep]
        assert torch.equal(got[i], want)


def test_identical_copies_never_flip(moe):
    model, ids, mask = moe
    flips = compare_routing(model, copy.deepcopy(model), ids, mask)
    assert (
        flips.rate == 0.0
        and flips.any_layer == 0.0
        and flips.per_layer == [0.0, 0.0]
        and flips.tokens == int(mask.sum())
    )


def test_swapping_two_experts_of_the_last_router_flips_exactly_the_tokens_with_one_of_them(moe):
    model, ids, mask = moe
    other = copy.deepcopy(model)
    with torch.no_grad():
        w = other.model.layers[1].mlp.gate.weight  # [E, H]
        w[[0, 1]] = w[[1, 0]].clone()
    sets = top_k_experts(model, ids, mask)[1]  # [N, 2] layer 1 under the original
    has0, has1 = (sets == 0).any(-1), (sets == 1).any(-1)
    expected = (has0 ^ has1).double().mean().item()  # a set holding both, or neither, is unchanged
    assert 0 < expected < 1
    flips = compare_routing(model, other, ids, mask)
    assert flips.per_layer[0] == 0.0  # layer 0's router and inputs are untouched
    assert flips.per_layer[1] == pytest.approx(expected, abs=1e-12)
    assert flips.rate == pytest.approx(expected / 2, abs=1e-12) and flips.any_layer == pytest.approx(
        expected, abs=1e-12
    )


def test_a_low_precision_copy_is_compared_in_its_own_dtype(moe):
    model, ids, mask = moe
    low = copy.deepcopy(model).to(torch.bfloat16)
    flips = compare_routing(model, low, ids, mask)
    assert 0.0 <= flips.rate <= flips.any_layer <= 1.0 and len(flips.per_layer) == 2


def test_padding_is_not_counted(moe):
    model, ids, mask = moe
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[1].mlp.gate.weight.neg_()  # routes (nearly) everything elsewhere
    full = compare_routing(model, other, ids[:1], mask[:1])
    assert full.tokens == 9 and full.per_layer[1] > 0.5


def test_a_dense_model_is_refused():
    tok = build_char_tokenizer("01")
    dense = build_tiny_model(tok, SHAPE, seed=0)
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        compare_routing(dense, dense, torch.tensor([[3, 4]]))
