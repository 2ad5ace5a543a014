"""Partial rollouts (rollout.partial): a weight sync lands while a batch is being generated, so the
later tokens of its responses are sampled by the newer policy. The engine wrapper's records
against teacher forcing, the stored per-token versions, the draws, determinism, resume, replay,
the token-age analysis and bad input."""

import json
from types import SimpleNamespace

import pytest
import torch

from masktrl.config import load_config
from masktrl.errors import ArtifactError, ConfigError
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rl.schedule import partial_at, sampled_at, token_age_metrics
from masktrl.rollout.base import Generation, Sample, SamplingSettings
from masktrl.rollout.hf import HFEngine
from masktrl.rollout.partial import PartialEngine
from masktrl.rollout.storage import read_rollouts, write_rollouts
from tests.conftest import TIMING, masktrl, write_tiny_config

# --------------------------------------------------------------------------- the engine wrapper


@pytest.fixture(scope="module")
def two_policies():
    tok = build_char_tokenizer("0123456789+=")
    cfg = TinyModelConfig(hidden_size=64, intermediate_size=128)
    old = build_tiny_model(tok, cfg, seed=0).eval()
    new = build_tiny_model(tok, cfg, seed=1).eval()
    return tok, old, new


def _teacher_forced(model, prompt, response, temperature):
    """[T, V] float64 log-probabilities of ``model`` at each response position (prompt + prefix)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits / temperature, -1)


@pytest.mark.parametrize("drop_finished", [False, True])
@pytest.mark.parametrize("at", [1, 3])
def test_tokens_after_the_sync_carry_the_newer_version_and_its_log_mu(two_policies, drop_finished, at):
    tok, old, new = two_policies
    engine = HFEngine(new, tok, batch_size=16, drop_finished=drop_finished)
    wrapped = PartialEngine(engine, old, new, at, (4, 5))
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+3=", "1+2=", "7+8=")]
    s = SamplingSettings(n=3, max_new_tokens=6, temperature=0.7, logprobs_k=5)
    out = wrapped.generate(prompts, s, seed=3)
    assert engine.model is new  # the engine is left on the newer policy
    switched = 0
    for prompt, group in zip(prompts, out):
        assert len(group) == 3
        for gen in group:
            T = len(gen.response_ids)
            assert len(gen.version) == len(gen.logp) == len(gen.topk_ids) == len(gen.topk_logp) == T <= 6
            assert gen.version == [4] * min(T, at) + [5] * max(0, T - at)
            if T > at:
                assert not any(x == tok.eos_token_id for x in gen.response_ids[:at])  # continued only if running
                switched += 1
            ref_old = _teacher_forced(old, prompt, gen.response_ids, 0.7)  # [T, V]
            ref_new = _teacher_forced(new, prompt, gen.response_ids, 0.7)
            ref = torch.where(torch.tensor(gen.version)[:, None] == 5, ref_new, ref_old)  # the sampling policy's
            want = ref.gather(1, torch.tensor(gen.response_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(gen.logp, dtype=torch.float64), want, atol=2e-5, rtol=0)
            top_lp, top_ids = ref.topk(5, -1)
            torch.testing.assert_close(torch.tensor(gen.topk_logp, dtype=torch.float64), top_lp, atol=2e-5, rtol=0)
            assert torch.equal(torch.tensor(gen.topk_ids), top_ids)
            assert gen.finished == (gen.response_ids[-1] == tok.eos_token_id)
    assert switched  # some responses ran past the sync
    again = PartialEngine(engine, old, new, at, (4, 5)).generate(prompts, s, seed=3)
    assert [[g.response_ids for g in grp] for grp in again] == [[g.response_ids for g in grp] for grp in out]


# --------------------------------------------------------------------------- draws, metrics, storage


def test_sync_positions_are_seeded_draws_inside_the_response():
    assert partial_at(None, 0, 5, 8) is None
    draws = [partial_at(0.5, 7, t, 8) for t in range(1, 2001)]
    assert draws == [partial_at(0.5, 7, t, 8) for t in range(1, 2001)]  # a pure function of seed and step
    assert draws != [partial_at(0.5, 8, t, 8) for t in range(1, 2001)]
    hit = [k for k in draws if k is not None]
    assert abs(len(hit) / len(draws) - 0.5) < 0.05 and set(hit) == set(range(1, 8))
    assert all(partial_at(1.0, 0, t, 8) is not None for t in range(1, 100))


def test_token_age_metrics():
    assert token_age_metrics([None, None], 3) == {}
    row = token_age_metrics([[0, 0, 1], [1, 1]], 3)  # ages 2 2 1 | 1 1
    assert row["rollout_token_age_mean"] == pytest.approx(7 / 5)
    assert row["rollout_token_age_max"] == 2 and row["rollout_partial_frac"] == 0.5
    assert row["rollout_token_age/1"] == 3 and row["rollout_token_age/2"] == 2


def _sample(ids, version):
    gen = Generation(ids, [-0.5] * len(ids), [[i] for i in ids], [[-0.5]] * len(ids), True, version=version)
    return Sample("e", "p", "a", [1, 2], 0, gen, reward=1.0)


def test_version_column_round_trips_and_is_absent_without_versions(tmp_path):
    import pyarrow.parquet as pq

    write_rollouts(tmp_path / "v.parquet", [_sample([3, 4, 5], [2, 2, 3]), _sample([6], [2])], {})
    samples, _ = read_rollouts(tmp_path / "v.parquet")
    assert [s.gen.version for s in samples] == [[2, 2, 3], [2]]
    write_rollouts(tmp_path / "n.parquet", [_sample([3, 4, 5], None)], {})
    assert "version" not in pq.ParquetFile(tmp_path / "n.parquet").schema_arrow.names
    assert read_rollouts(tmp_path / "n.parquet")[0][0].gen.version is None
    with pytest.raises(ValueError, match="every sample"):
        write_rollouts(tmp_path / "m.parquet", [_sample([3], [1]), _sample([4], None)], {})
    write_rollouts(tmp_path / "bad.parquet", [_sample([3, 4], [0, -1])], {})
    with pytest.raises(ArtifactError, match="policy version -1 is negative"):
        read_rollouts(tmp_path / "bad.parquet")


def test_dynamics_counts_and_plots_token_ages():
    from masktrl.analysis import plots
    from masktrl.analysis.dynamics import TOKEN_AGE, metric_list, token_age_counts

    runs = [
        SimpleNamespace(metrics=[{"step": 1, "rollout_token_age_mean": 0.5, "rollout_token_age/0": 3}]),
        SimpleNamespace(
            metrics=[{"step": 1, "rollout_token_age_mean": 0.4, "rollout_token_age/0": 3, "rollout_token_age/1": 2}]
        ),
    ]
    assert token_age_counts(runs) == {"0": 6, "1": 2}
    assert TOKEN_AGE in metric_list(runs) and TOKEN_AGE not in metric_list([SimpleNamespace(metrics=[{"step": 1}])])
    fig = plots.age_histogram(
        [{"label": "grpo", "runs": ["a", "b"], "token_ages": token_age_counts(runs)}], tokens=True
    )
    assert [p.get_height() for p in fig.axes[0].patches] == pytest.approx([0.75, 0.25])
    assert fig.axes[0].get_xlabel().startswith("token age")


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "rollout, needle",
    [
        ({"partial": 0.5}, "needs rollout.staleness > 0"),
        ({"partial": 1.5, "staleness": 1}, "rollout.partial must be a probability"),
        ({"partial": 0, "staleness": 1}, "rollout.partial must be a probability"),
        ({"partial": "yes", "staleness": 1}, "rollout.partial must be a number"),
        ({"partial": 1.0, "staleness": 1, "max_new_tokens": 1}, "max_new_tokens >= 2"),
        ({"partial": 1.0, "staleness": {"dist": "uniform", "max": 0}}, "needs rollout.staleness > 0"),
    ],
)
def test_bad_partial_settings_are_config_errors(tmp_path, rollout, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(write_tiny_config(tmp_path / "c.yaml", {"rollout": rollout}))


@pytest.mark.parametrize(
    "sets, words",
    [
        (["rollout.partial=0.5"], "needs rollout.staleness > 0"),
        (["rollout.partial=1", "rollout.staleness={dist: poisson, max: 2}"], "rollout.staleness.dist"),
        (["rollout.partial=1", "rollout.staleness={dist: uniform, min: 3, max: 1}"], "below the minimum age"),
        (["rollout.partial=1", "rollout.staleness=1", "task.env=masktrl.tasks.tools:Calculator"], "task.env"),
    ],
)
@pytest.mark.parametrize("dry", [False, True])
def test_bad_input_is_one_line_and_writes_nothing(cli_error, tmp_path, sets, words, dry):
    cfg = write_tiny_config(tmp_path / "c.yaml")
    out = tmp_path / "out"
    args = [a for s in sets for a in ("--set", s)]
    line = cli_error("train", "--config", cfg, "--out", out, "--run", "r", *args, *(["--dry-run"] if dry else []))
    assert words in line
    assert not out.exists()


def test_dry_run_line(tmp_path):
    from masktrl.rl.checks import check_partial

    overlay = {"rollout": {"partial": 0.25, "staleness": {"dist": "geometric", "max": 2}}}
    cfg = load_config(write_tiny_config(tmp_path / "c.yaml", overlay))
    assert check_partial(cfg).startswith("a weight sync lands in 0.25 of the batches sampled ahead")


# --------------------------------------------------------------------------- runs

SPEC = {"dist": "geometric", "max": 2, "p": 0.5}


def _rows(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _train(cfg, out, run, *args, env=None):
    r = masktrl("train", "--config", cfg, "--out", out, "--run", run, *args, cwd=out.parent, env=env)
    return r


@pytest.mark.slow
def test_a_partial_run_stores_versions_whose_log_mu_is_the_sampling_policys(tmp_path, warm_out):
    """Every stored token carries the version of the policy that sampled it: sigma(t) - 1 before the
    drawn sync position and sigma(t) after it for batches sampled ahead, and its stored log mu is
    that checkpoint's log-probability by teacher forcing."""
    from masktrl.models.loading import load_model_and_tokenizer
    from masktrl.runs.store import RunStore

    cfg = write_tiny_config(
        tmp_path / "c.yaml",
        {"rollout": {"staleness": SPEC, "partial": 1.0, "max_new_tokens": 6}, "train": {"steps": 4}},
    )
    r = _train(cfg, warm_out, "partial-v")
    assert r.returncode == 0, r.stderr
    run, store = warm_out / "partial-v", RunStore(warm_out / "partial-v", writable=False)
    rows = _rows(run)
    switched = 0
    for t in range(1, 5):
        sigma = sampled_at(SPEC, 0, t)
        at = partial_at(1.0, 0, t, 6) if sigma < t else None
        samples, _ = read_rollouts(run / "steps" / f"{t:06d}" / "rollouts.parquet")
        models = {}
        for s in samples:
            T = len(s.gen.response_ids)
            want = [sigma - 1] * T if at is None else [sigma - 1] * min(T, at) + [sigma] * max(0, T - at)
            assert s.gen.version == want
            for v in s.gen.version:
                if v not in models:
                    models[v] = load_model_and_tokenizer(store.policy_path(v), "float32")[0].eval()
            ref = torch.stack(
                [
                    _teacher_forced(models[v], s.prompt_ids, s.gen.response_ids, 1.0)[pos, s.gen.response_ids[pos]]
                    for pos, v in enumerate(s.gen.version)
                ]
            )
            torch.testing.assert_close(torch.tensor(s.gen.logp, dtype=torch.float64), ref, atol=2e-5, rtol=0)
            switched += len(set(s.gen.version)) > 1
        ages = [t - 1 - v for s in samples for v in s.gen.version]
        assert rows[t - 1]["rollout_token_age_mean"] == pytest.approx(sum(ages) / len(ages))
    assert switched


@pytest.mark.slow
def test_partial_run_reruns_resumes_and_replays_bit_identically(tmp_path, warm_out):
    cfg = write_tiny_config(
        tmp_path / "c.yaml", {"rollout": {"staleness": SPEC, "partial": 0.7}, "train": {"steps": 5}}
    )
    for run in ("a", "b"):
        r = _train(cfg, warm_out, f"part-{run}")
        assert r.returncode == 0, r.stderr
    a = _rows(warm_out / "part-a")
    assert a == _rows(warm_out / "part-b")  # same seed, same machine, same threads: the same run
    assert any(row["rollout_partial_frac"] > 0 for row in a)
    r = _train(cfg, warm_out, "part-c", env={"MASKTRL_CRASH_AT": "update:4"})
    assert r.returncode != 0
    r = masktrl("train", "--config", cfg, "--out", warm_out, "--resume", "part-c", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert _rows(warm_out / "part-c") == a
    # killed while a partial batch is in flight: after the update that lands in it, before it is stored
    t = next(t for t in range(2, 6) if sampled_at(SPEC, 0, t) < t and partial_at(0.7, 0, t, 4) is not None)
    r = _train(cfg, warm_out, "part-d", env={"MASKTRL_CRASH_AT": f"rollout-write:{t}"})
    assert r.returncode != 0 and not (warm_out / "part-d" / f"steps/{t:06d}/rollouts.parquet").exists()
    r = masktrl("train", "--config", cfg, "--out", warm_out, "--resume", "part-d", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    final = "checkpoints/000005/model.safetensors"
    for run in ("part-c", "part-d"):
        assert _rows(warm_out / run) == a
        assert (warm_out / run / final).read_bytes() == (warm_out / "part-a" / final).read_bytes()
        for t in range(1, 6):
            name = f"steps/{t:06d}/rollouts.parquet"
            assert (warm_out / run / name).read_bytes() == (warm_out / "part-a" / name).read_bytes()
    # replayed: the stored versions train as they are, the token ages as in the source run
    plain = write_tiny_config(tmp_path / "p.yaml", {"train": {"steps": 5}})
    r = _train(plain, warm_out, "part-replay", "--rollouts-from", warm_out / "part-a")
    assert r.returncode == 0, r.stderr
    replay = _rows(warm_out / "part-replay")
    ages = [{k: v for k, v in row.items() if k.startswith("rollout_token_age")} for row in replay]
    assert ages == [{k: v for k, v in row.items() if k.startswith("rollout_token_age")} for row in a]
    for t in range(1, 6):
        name = f"steps/{t:06d}/rollouts.parquet"
        got, _ = read_rollouts(warm_out / "part-replay" / name)
        want, _ = read_rollouts(warm_out / "part-a" / name)
        assert [s.gen.version for s in got] == [s.gen.version for s in want]


def test_exact_behaviour_refuses_a_batch_of_two_versions():
    from masktrl.analysis.step_replay import load_behaviour
    from masktrl.errors import MasktrlError

    replay = SimpleNamespace(step=3, policy_step=2, samples=[_sample([3, 4], [0, 1]), _sample([5], [0])])
    with pytest.raises(MasktrlError, match="sampled by policies 0..1"):
        load_behaviour(replay, 0)


def test_mismatch_of_a_partial_batch_reads_each_token_at_the_weights_that_sampled_it(two_policies):
    from masktrl.rl.mismatch import measure_mismatch, partial_mismatch

    tok, old, new = two_policies
    engine = HFEngine(new, tok, batch_size=16)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+3=", "4+5=")]
    out = PartialEngine(engine, old, new, 2, (0, 1)).generate(prompts, SamplingSettings(n=3, max_new_tokens=6), 1)
    samples = [Sample("e", "", "", p, g, gen) for g, (p, group) in enumerate(zip(prompts, out)) for gen in group]
    assert any(1 in s.gen.version for s in samples) and any(0 in s.gen.version for s in samples)
    got = partial_mismatch(old, new, samples, 1.0, 7, pieces=2)
    assert got["mismatch/logp_abs_mean"] < 1e-5  # the sampling policy's own log-probabilities
    assert measure_mismatch(new, new, None, samples, 1.0, 7)["mismatch/logp_abs_mean"] > 1e-2  # one policy: off
