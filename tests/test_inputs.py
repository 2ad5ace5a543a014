"""Finite or refused, below the commands: advantages of extreme rewards, rollout batches with
non-finite numbers, sampling settings, method names of the wrong type, data files that are
empty or not UTF-8, a reward that fails on most completions."""

import math
import random
from decimal import Decimal, getcontext

import pytest

from masktrl.errors import ConfigError, DataError
from masktrl.methods import get_method, group_advantages
from masktrl.rollout.base import SamplingSettings, check_sampling
from masktrl.tasks.dataset import load_rows
from masktrl.tasks.rewards import check_reward_errors

getcontext().prec = 60


def reference(rewards, norm="group-std", eps=1e-6):
    """One group's advantages in 60-digit decimals (no overflow at any float64 magnitude)."""
    r = [Decimal(x) for x in rewards]
    mean = sum(r) / len(r)
    centred = [x - mean for x in r]
    if norm == "none":
        return [float(c) for c in centred]
    std = (sum(c * c for c in centred) / (len(r) - 1)).sqrt() if len(r) > 1 else Decimal(0)
    return [float(c / (std + Decimal(eps))) for c in centred]


@pytest.mark.parametrize("scale", [1e308, -1e308, 1.7976931348623157e308, 1e300])
def test_advantages_of_rewards_near_the_float_limit_are_finite_and_right(scale):
    rng = random.Random(0)
    for _ in range(20):
        rewards = [scale * rng.uniform(-1, 1) for _ in range(rng.randint(2, 8))]
        got = group_advantages(rewards, [0] * len(rewards)).tolist()
        assert all(math.isfinite(a) for a in got)
        assert got == pytest.approx(reference(rewards), rel=1e-12, abs=1e-12)


def test_plus_minus_1e308_rewards_give_finite_advantages():
    got = group_advantages([1e308, -1e308, 1e308, -1e308], [0, 0, 0, 0])  # the plain formula: std overflows, all 0
    assert got.tolist() == pytest.approx([math.sqrt(3) / 2, -math.sqrt(3) / 2] * 2, rel=1e-15)  # eps / 1e308 vanishes
    assert group_advantages([1e308, 1e308, 1e308, 0.0], [0] * 4).tolist() == pytest.approx([0.5, 0.5, 0.5, -1.5])
    assert group_advantages([1e308, -1e308], [0, 0], norm="none").tolist() == [1e308, -1e308]


def test_advantages_that_cannot_be_a_float_are_refused():
    rewards = [1.5e308, -1.5e308, -1.5e308, -1.5e308]  # centred: 2.25e308, beyond the largest float
    assert reference(rewards, "none")[0] == math.inf
    with pytest.raises(
        ValueError,
        match=r"advantages are not finite: rewards from -1.5e\+308 to 1.5e\+308 are further apart "
        r"than the largest float \(adv_norm=none\)",
    ):
        group_advantages(rewards, [0] * 4, norm="none")
    assert all(math.isfinite(a) for a in group_advantages(rewards, [0] * 4).tolist())  # group-std is scale-free


def whiten_reference(x, eps=1e-8):
    x = [Decimal(v) for v in x]
    m = sum(x) / len(x)
    v = sum((a - m) ** 2 for a in x) / (len(x) - 1)
    return [float((a - m) / (v + Decimal(eps)).sqrt()) for a in x]


@pytest.mark.parametrize("norm", ["batch-std", "reinforce++", "reinforce++-baseline", "rloo"])
def test_every_estimator_is_finite_and_right_near_the_float_limit(norm):
    rng = random.Random(1)
    rewards = [1e308 * rng.uniform(-0.45, 0.45) for _ in range(8)]  # spread < 0.9e308: every estimator is a float
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    got = group_advantages(rewards, groups, norm=norm).tolist()
    assert all(math.isfinite(a) for a in got)
    centred = [c for k in (0, 4) for c in reference(rewards[k : k + 4], "none")]
    r = [Decimal(x) for x in rewards]
    batch_std = float((sum((x - sum(r) / 8) ** 2 for x in r) / 7).sqrt())
    want = {
        "reinforce++": whiten_reference(rewards),
        "reinforce++-baseline": whiten_reference(centred),
        "rloo": [c * 4 / 3 for c in centred],
        "batch-std": [c / batch_std for c in centred],
    }[norm]
    assert got == pytest.approx(want, rel=1e-12)


def test_method_name_of_the_wrong_type_is_a_value_error():
    for name in ([1], {"a": 1}, None, 3):
        with pytest.raises(ValueError, match="unknown method"):
            get_method(name)


WHY = "(below it sampling is greedy decoding but for ties, and logits / T can overflow), got "


@pytest.mark.parametrize(
    "temperature, top_p, needle",
    [
        (math.inf, 1.0, f"temperature must be a finite number >= 1e-05 {WHY}inf"),
        (math.nan, 1.0, f"temperature must be a finite number >= 1e-05 {WHY}nan"),
        (1e-320, 1.0, f"temperature must be a finite number >= 1e-05 {WHY}1e-320"),
        (0.0, 1.0, f"temperature must be a finite number >= 1e-05 {WHY}0.0"),
        (1.0, math.nan, "top_p must be in (0, 1], got nan"),
        (1.0, 0.0, "top_p must be in (0, 1], got 0.0"),
        (1.0, 1.5, "top_p must be in (0, 1], got 1.5"),
    ],
)
def test_sampling_settings_refuse_non_finite_values(temperature, top_p, needle):
    with pytest.raises(ConfigError) as e:
        SamplingSettings(temperature=temperature, top_p=top_p)
    assert str(e.value) == needle
    with pytest.raises(ConfigError, match=r"^--temperature|^--top-p"):
        check_sampling(temperature, top_p, names=("--temperature", "--top-p"))
    SamplingSettings(temperature=0.5, top_p=0.9)


@pytest.mark.parametrize(
    "name, data, needle",
    [
        ("empty.jsonl", b"", "empty.jsonl: empty file (no rows)"),
        ("blank.json", b"  \n\n", "blank.json: empty file (no rows)"),
        ("header.csv", b"prompt,answer\n", "header.csv: a header and no rows"),
        (
            "latin.jsonl",
            b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "3"}\n',
            "latin.jsonl, line 2: not UTF-8 text (byte 0xe9)",
        ),
        ("latin.csv", b"prompt,answer\n1+1=\xff,2\n", "latin.csv, line 2: not UTF-8 text (byte 0xff)"),
    ],
)
def test_data_files_that_are_empty_or_not_utf8_are_one_line(tmp_path, name, data, needle):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(DataError) as e:
        load_rows(str(path))
    assert str(e.value) == f"{tmp_path}/{needle}"


def test_parquet_text_that_is_not_utf8_is_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "bad.parquet"
    prompts = pa.array([b"1+1=\xff", b"2+2="], pa.binary()).view(pa.string())  # unchecked: a foreign writer's bytes
    pq.write_table(pa.table({"prompt": prompts, "answer": ["2", "4"]}), path)
    with pytest.raises(DataError, match=r"bad.parquet: a text field is not UTF-8 \(byte 0xff: invalid start byte\)"):
        load_rows(str(path))


def test_reward_failures_warn_then_stop_past_the_threshold():
    assert check_reward_errors(3, 0, 24, 0.5) is None
    assert check_reward_errors(3, 2, 24, 0.5) is None  # 8%: sporadic failures are only counted
    warn = check_reward_errors(3, 6, 24, 0.5, "r.py:score raised")
    assert warn == (
        "step 3: the reward failed on 6 of 24 completions (25%; last: r.py:score raised); "
        "they score 0 (the run stops above task.max_reward_error_frac=0.5)"
    )
    assert check_reward_errors(3, 12, 24, 0.5) is not None  # exactly half: a warning
    with pytest.raises(ConfigError) as e:
        check_reward_errors(3, 24, 24, 0.5, "r.py:score raised")
    assert str(e.value) == (
        "step 3: the reward failed on 24 of 24 completions (100%; last: r.py:score raised); "
        "the run stops (task.max_reward_error_frac=0.5): fix task.reward"
    )
    assert check_reward_errors(3, 24, 24, 1.0) is not None  # 1.0: never stops, still warns


def test_rollout_file_with_deep_metadata_is_one_line(tmp_path):
    import pyarrow.parquet as pq

    from masktrl.errors import ArtifactError
    from masktrl.rollout.storage import read_rollouts, write_rollouts
    from tests.test_rollout_storage import make_samples

    path = tmp_path / "r.parquet"
    write_rollouts(path, make_samples(), {"temperature": 1.0}, fmt=1)
    table = pq.read_table(path)
    deep = ('{"a": ' * 5000 + "1" + "}" * 5000).encode()
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"masktrl": deep}), path)
    with pytest.raises(ArtifactError) as e:
        read_rollouts(path)
    assert str(e.value) == f"{path}: rollout file metadata is not valid JSON (JSON nested deeper than 64 levels)"
