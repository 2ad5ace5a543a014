"""Routing replay (R3, ``model.routing_replay: rollout``): the engine records every token's
experts, the training forward replays them (models/moe.py, rl/policy.py, rl/mismatch.py)."""

import json

import pytest
import torch
import torch.nn.functional as F

from masktrl.models.moe import moe_routers, replayed_routing, routing, routing_records, routing_targets
from masktrl.rollout.base import Sample, SamplingSettings
from tests.conftest import cli, write_tiny_config
from tests.test_routing import tiny_moe

MOE = {"model": {"architecture": "qwen3-moe"}}


def f64_moe():
    model = tiny_moe().double()
    model.set_experts_implementation("eager")  # the grouped-GEMM kernel takes no float64
    return model


def _loss(model, ids):
    logits = model(input_ids=ids).logits.double()
    return torch.log_softmax(logits, -1).gather(-1, ids.roll(-1, 1)[..., None]).sum()


def _grads(model, ids, experts=None):
    model.zero_grad()
    if experts is None:
        loss = _loss(model, ids)
    else:
        with replayed_routing(model, experts):
            loss = _loss(model, ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _as_targets(r):  # [L, B, S, k] -> [L, B*S, k]
    return r.reshape(r.shape[0], -1, r.shape[-1])


def test_replaying_the_models_own_routing_is_the_ordinary_forward_bit_for_bit():
    model = f64_moe()
    ids = torch.randint(0, 40, (3, 9), generator=torch.Generator().manual_seed(2))
    own = _as_targets(routing(model, ids))
    loss, grads = _grads(model, ids)
    loss_r, grads_r = _grads(model, ids, own)
    assert torch.equal(loss, loss_r)
    assert grads.keys() == grads_r.keys() and all(torch.equal(grads[n], grads_r[n]) for n in grads)


def _fixed_choice_router(experts_of_layer):
    """A transcription of verl's replay_forward (verl/utils/megatron/router_replay_patch.py
    L184 with moe_router_pre_softmax, L202-203: scores = softmax(logits); probs =
    scores.gather(1, top_indices)) and slime's (slime/utils/routing_replay.py L197), with
    Qwen3-MoE's top-k renormalisation: the router's forward with the expert choice fixed."""

    def forward(self, hidden_states):
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(h, self.weight)
        scores = torch.softmax(logits, dim=-1, dtype=torch.float)
        top = experts_of_layer[self]
        probs = scores.gather(1, top)
        if self.norm_topk_prob:
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return logits, probs.to(logits.dtype), top

    return forward


@pytest.mark.parametrize("norm", [False, True])
def test_the_replayed_gradient_is_autograd_of_the_forward_with_the_expert_choice_fixed(monkeypatch, norm):
    model = f64_moe()
    for _, router, _ in moe_routers(model):
        router.norm_topk_prob = norm
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 40, (2, 7), generator=g)
    layers, t = len(moe_routers(model)), ids.numel()
    forced = torch.stack(
        [torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)]) for _ in range(layers)]
    )  # [L, T, 2]
    own = _as_targets(routing(model, ids))
    assert not torch.equal(forced.sort(-1).values, own.sort(-1).values)  # the replay really routes elsewhere
    loss_r, grads_r = _grads(model, ids, forced)

    from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

    routers = {module: forced[i] for i, (_, module, _) in enumerate(moe_routers(model))}
    monkeypatch.setattr(qm.Qwen3MoeTopKRouter, "forward", _fixed_choice_router(routers))
    loss_ref, grads_ref = _grads(model, ids)
    assert torch.allclose(loss_r, loss_ref, rtol=0, atol=1e-12)
    assert grads_r.keys() == grads_ref.keys()
    for n in grads_ref:
        assert torch.allclose(grads_r[n], grads_ref[n], rtol=1e-10, atol=1e-12), n
    gate = [n for n in grads_r if n.endswith("mlp.gate.weight")]
    assert gate and all(grads_r[n].abs().sum() > 0 for n in gate)  # the router's logits still learn


def test_routing_targets_layout_and_padding():
    rec = [[[1, 2, 3, 4]] * 2, [[5, 6, 7, 0]]]  # 2 layers x k=2; rows of 2 and 1 positions
    out = routing_targets(rec, width=3, layers=2, k=2)
    assert out.shape == (2, 6, 2)
    assert out[0].tolist() == [[1, 2], [1, 2], [0, 1], [5, 6], [0, 1], [0, 1]]
    assert out[1].tolist() == [[3, 4], [3, 4], [0, 1], [7, 0], [0, 1], [0, 1]]


def _engine_batch(record=True, quantization="fp8-act"):
    from masktrl.models.tiny import build_char_tokenizer
    from masktrl.rollout.hf import HFEngine

    tok = build_char_tokenizer("0123456789+=")
    model = tiny_moe()
    model.resize_token_embeddings(len(tok))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+3=", "7+8=", "9+9=")]
    engine = HFEngine(model, tok, dtype="bfloat16", quantization=quantization)
    engine.record_routing = record
    gens = engine.generate(prompts, SamplingSettings(n=4, max_new_tokens=6, logprobs_k=5), seed=0)
    samples = [Sample(str(i), "", "", p, i, g) for i, (p, group) in enumerate(zip(prompts, gens)) for g in group]
    return model, engine, samples


def test_the_engine_records_its_copys_routing_and_the_file_keeps_it(tmp_path):
    from masktrl.rollout.storage import has_routing_column, read_rollouts, write_rollouts

    model, engine, samples = _engine_batch()
    s = samples[5]
    assert len(s.gen.routing) == len(s.prompt_ids) + len(s.gen.response_ids) and len(s.gen.routing[0]) == 2 * 2
    assert s.gen.routing == routing_records(engine.model, [s.prompt_ids + s.gen.response_ids])[0]  # the engine's copy
    write_rollouts(tmp_path / "r.parquet", samples, {})
    back, _ = read_rollouts(tmp_path / "r.parquet")
    assert [b.gen.routing for b in back] == [x.gen.routing for x in samples] and has_routing_column(
        tmp_path / "r.parquet"
    )
    _, _, plain = _engine_batch(record=False)
    assert all(x.gen.routing is None for x in plain)
    write_rollouts(tmp_path / "p.parquet", plain, {})  # no routing: no column, and the file reads as before
    assert not has_routing_column(tmp_path / "p.parquet")
    assert all(b.gen.routing is None for b in read_rollouts(tmp_path / "p.parquet")[0])


def test_under_replay_the_trainer_never_flips_while_its_own_routers_would():
    from masktrl.rl.mismatch import measure_mismatch
    from masktrl.rl.policy import enable_routing_replay, policy_token_batch

    model, engine, samples = _engine_batch()
    plain = measure_mismatch(model, model, engine, samples, 1.0, 1024)
    enable_routing_replay(model, engine)
    stats = measure_mismatch(model, model, engine, samples, 1.0, 1024, pieces=2)
    assert stats["mismatch/routing_flip_rate"] == 0.0
    assert stats["mismatch/routing_flip_rate_router"] == pytest.approx(plain["mismatch/routing_flip_rate"], rel=1e-6)
    assert plain["mismatch/routing_flip_rate"] > 0  # the same comparison as without the replay: copy vs trainer
    assert stats["mismatch/logp_abs_mean"] > 0  # the experts' outputs and gate weights still differ (bf16/FP8 copy)
    with pytest.raises(Exception, match="have no recorded routing"):
        samples[0].gen.routing = None
        policy_token_batch(model, samples, 1.0, 1024)


def test_an_engine_without_routing_is_refused():
    from masktrl.errors import MasktrlError
    from masktrl.rl.policy import enable_routing_replay

    class NoRouting:
        name = "vllm"

    with pytest.raises(MasktrlError, match="the engine cannot report its routing"):
        enable_routing_replay(torch.nn.Linear(1, 1), NoRouting())


@pytest.mark.parametrize(
    "overlay, sets, words",
    [
        ({}, ["model.routing_replay=rollout"], "model.architecture=qwen3 is dense"),
        (
            MOE,
            ["model.routing_replay=rollout", "rollout.engine=vllm"],
            "rollout.engine=vllm: the engine cannot report its routing",
        ),
        (MOE, ["model.routing_replay=rollout", "train.packing=true"], "set train.packing=false"),
        (MOE, ["model.routing_replay=yes"], "model.routing_replay must be one of rollout"),
    ],
)
@pytest.mark.parametrize("dry", [False, True])
def test_bad_input_is_one_line_and_writes_nothing(cli_error, tmp_path, overlay, sets, words, dry):
    cfg = write_tiny_config(tmp_path / "c.yaml", overlay)
    out = tmp_path / "out"
    args = [a for s in sets for a in ("--set", s)]
    line = cli_error("train", "--config", cfg, "--out", out, "--run", "r", *args, *(["--dry-run"] if dry else []))
    assert words in line
    assert not out.exists()


@pytest.mark.slow
def test_a_short_moe_run_with_replay_under_fp8_logs_no_routing_flip(tmp_path, cli_error):
    """Acceptance: the MoE model with model.routing_replay=rollout under fp8 logs routing_flip_rate
    0 in training, while the trainer's own routers would have flipped; a file of such a run
    replays, one without routing is refused."""
    cfg = write_tiny_config(
        tmp_path / "c.yaml",
        {
            "model": {"architecture": "qwen3-moe", "hidden_size": 64, "num_layers": 2},
            "rollout": {"quantization": "fp8"},
        },
    )
    out = tmp_path / "out"
    cli("train", "--config", cfg, "--out", out, "--run", "plain")
    cli("train", "--config", cfg, "--out", out, "--run", "r3", "--set", "model.routing_replay=rollout")
    rows = [json.loads(x) for x in (out / "r3" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["mismatch/routing_flip_rate"] == 0.0 for r in rows)
    assert any(r["mismatch/routing_flip_rate_router"] > 0 for r in rows)
    assert all(r["mismatch/logp_abs_mean"] > 0 for r in rows)
    plain = [json.loads(x) for x in (out / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert "mismatch/routing_flip_rate_router" not in plain[0]
    # step 1 samples the same batch at the same weights in both runs: the routers' own rate is the plain run's flip rate
    assert rows[0]["mismatch/routing_flip_rate_router"] == pytest.approx(
        plain[0]["mismatch/routing_flip_rate"], abs=1e-7
    )
    cli(
        "train",
        "--config",
        cfg,
        "--out",
        out,
        "--run",
        "again",
        "--set",
        "model.routing_replay=rollout",
        "--rollouts-from",
        out / "r3",
    )
    before = sorted(p.name for p in out.iterdir())
    line = cli_error(
        "train",
        "--config",
        cfg,
        "--out",
        out,
        "--run",
        "no",
        "--set",
        "model.routing_replay=rollout",
        "--rollouts-from",
        out / "plain",
    )
    assert "has no recorded routing" in line and sorted(p.name for p in out.iterdir()) == before
