"""Rollout files: format 2 round-trips every number bit for bit, format 1 still reads, and every
malformed file is refused with one line naming the file and row (masktrl/rollout/storage.py)."""

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from masktrl.errors import ArtifactError, DataError
from masktrl.rollout import storage
from masktrl.rollout.base import Generation, Sample
from masktrl.rollout.storage import logp_from_steps, logp_steps, read_rollouts, write_rollouts

INF = float("inf")


def make_samples(rows=6, vocab=50, k=8, max_len=7, bf16=False, top_p_cut=None, seed=0) -> list[Sample]:
    """Responses sampled from log_softmax of random float32 (or bf16-valued) logits, as the engines
    record them; ``top_p_cut``: only that many tokens keep mass (the rest -inf, zero-mass entries)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for r in range(rows):
        t_len = 1 + r % max_len
        z = torch.randn((t_len, vocab), generator=g) * 3 + 10
        if bf16:
            z = z.to(torch.bfloat16).float()
        if top_p_cut:
            z[:, torch.arange(vocab) >= top_p_cut] = -INF
        lp = torch.log_softmax(z, dim=-1)
        top_lp, top_ids = lp.topk(min(k, vocab), dim=-1)
        ids = torch.multinomial(lp.exp(), 1, generator=g)[:, 0]
        if k > vocab:  # vLLM pads short lists with -1 / -inf
            top_ids = torch.cat([top_ids, torch.full((t_len, k - vocab), -1)], 1)
            top_lp = torch.cat([top_lp, torch.full((t_len, k - vocab), -INF)], 1)
        gen = Generation(
            ids.tolist(),
            lp.gather(1, ids[:, None])[:, 0].tolist(),
            top_ids.tolist(),
            top_lp.tolist(),
            finished=bool(r % 2),
        )
        samples.append(
            Sample(
                f"ex{r // 2}",
                f"prompt {r // 2}",
                str(r),
                [1 + r // 2, 2, 3],
                r // 2,
                gen,
                text=f"t{r}",
                reward=float(r % 2),
                advantage=0.5 - r % 2,
            )
        )
    return samples


def fingerprint(samples):
    bits = lambda xs: np.asarray(xs, dtype=np.float32).view(np.uint32).tolist()  # noqa: E731
    return [
        (
            s.example_id,
            s.prompt,
            s.answer,
            s.prompt_ids,
            s.group,
            s.text,
            s.reward,
            s.advantage,
            s.gen.finished,
            s.gen.response_ids,
            bits(s.gen.logp),
            s.gen.topk_ids,
            [bits(row) for row in s.gen.topk_logp],
        )
        for s in samples
    ]


def codec(path):
    return json.loads(pq.read_table(path).schema.metadata[storage.CODEC_KEY])


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", ["tk", "kt"])
@pytest.mark.parametrize(
    "kw",
    [
        {},  # sampled tokens often outside the top-8 of 50: exceptions
        {"bf16": True},
        {"vocab": 5, "k": 8},  # K > vocabulary: -1 / -inf pads
        {"vocab": 40, "k": 8, "top_p_cut": 5},  # zero-mass (-inf) entries with valid ids
        {"vocab": 3000, "k": 20, "rows": 40},  # ids too spread for the id table: raw ids
    ],
)
def test_format2_round_trips_bit_exactly(tmp_path, kw, layout):
    samples = make_samples(**kw)
    path = tmp_path / "r.parquet"
    write_rollouts(path, samples, {"step": 3, "stats": {"tokens": 1}}, layout=layout)
    back, meta = read_rollouts(path, vocab_size=kw.get("vocab", 50))
    assert meta == {"step": 3, "stats": {"tokens": 1}}
    assert fingerprint(back) == fingerprint(samples)
    assert codec(path)["format"] == 2 and codec(path)["layout"] == layout


def test_codec_uses_its_shortcuts(tmp_path):
    """Sampled tokens found in the list are stored as ranks; ids repeating enough go through the table."""
    samples = make_samples(vocab=17, k=17, rows=30)  # every token is in its list
    path = tmp_path / "r.parquet"
    write_rollouts(path, samples, {})
    table = pq.read_table(path)
    assert table.column("response_ids_x").combine_chunks().flatten().to_pylist() == []
    assert codec(path)["topk_ids"] == "vocab" and len(table.column("topk_vocab")[0]) == 17


def test_logp_steps_invert_any_float32_bits():
    """The step transform is lossless for every bit pattern (NaN payloads, infinities, -0.0, subnormals)."""
    rng = np.random.default_rng(0)
    lp = rng.integers(0, 2**32, (300, 20), dtype=np.uint64).astype(np.uint32).view(np.float32)
    lp[:100] = np.sort(-np.abs(rng.standard_normal((100, 20)).astype(np.float32)) * 20, axis=1)[:, ::-1]
    lp[100:110, 10:] = -INF
    lp[110, :] = [-0.0, 0.0, np.nan, -INF, INF, 1e-45, -1e-45, 3.4e38, -3.4e38, -0.0] * 2
    steps, raw = logp_steps(lp)
    assert np.array_equal(logp_from_steps(steps, raw).view(np.uint32), lp.view(np.uint32))
    assert raw[:100].mean() < 0.01  # real lists almost never need the raw fallback


def test_bf16_steps_are_short():
    """bf16-valued logits give steps with at most bf16's 8 significant bits in nearly every entry."""
    z = torch.randn((200, 1000), generator=torch.Generator().manual_seed(1)).mul(3).add(20).to(torch.bfloat16).float()
    lp = torch.log_softmax(z, -1).topk(20, -1).values.numpy()
    steps, raw = logp_steps(lp)
    low = steps[:, 1:].view(np.uint32) & 0xFFFF
    assert (low == 0).mean() > 0.95 and not raw.any()


def test_format1_files_still_read(tmp_path):
    samples = make_samples(vocab=17, k=20)  # the HF engine's K = min(K, V) = 17 lists
    for s in samples:
        s.gen.topk_ids = [row[:17] for row in s.gen.topk_ids]
        s.gen.topk_logp = [row[:17] for row in s.gen.topk_logp]
    path = tmp_path / "old.parquet"
    write_rollouts(path, samples, {"engine": "hf"}, fmt=1)
    assert storage.CODEC_KEY not in pq.read_table(path).schema.metadata
    assert pq.read_table(path).schema == storage.SCHEMA_V1.with_metadata(pq.read_table(path).schema.metadata)
    back, meta = read_rollouts(path)
    assert meta == {"engine": "hf"} and fingerprint(back) == fingerprint(samples)


def test_empty_batch_and_empty_responses(tmp_path):
    path = tmp_path / "r.parquet"
    write_rollouts(path, [], {})
    assert read_rollouts(path) == ([], {})
    samples = make_samples(rows=2)
    samples[0].gen = Generation([], [], [], [], finished=False)
    write_rollouts(path, samples, {})
    assert fingerprint(read_rollouts(path)[0]) == fingerprint(samples)


# --------------------------------------------------------------------------- refused files


def refused(path, match, **kw):
    with pytest.raises(ArtifactError, match=match) as info:
        read_rollouts(path, **kw)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def write_v1_table(path, samples, **changes):
    """A format-1 file of ``samples`` with columns replaced by ``changes`` (pyarrow arrays)."""
    table = storage._encode_v1(
        samples,
        {
            n: [getattr(s, n) for s in samples]
            for n in ("example_id", "prompt", "answer", "group", "prompt_ids", "text", "reward", "advantage")
        }
        | {"finished": [s.gen.finished for s in samples]},
    )
    for name, arr in changes.items():
        table = table.set_column(table.column_names.index(name), name, arr)
    pq.write_table(table.replace_schema_metadata({"masktrl": "{}"}), path)


def test_behaviour_logp_moved_between_rows_is_refused(tmp_path):
    samples = make_samples(vocab=17, k=17)
    samples[2].gen.logp.append(samples[1].gen.logp.pop())
    path = tmp_path / "moved.parquet"
    write_rollouts(path, samples, {})  # ragged: written as format 1, unchanged
    refused(path, r"row 1: behavior_logp has length 1, response_ids 2")


def test_shifted_topk_lists_are_refused(tmp_path):
    samples = make_samples(vocab=17, k=17, rows=12)
    for s in samples:  # each position gets the next position's list
        s.gen.topk_ids = s.gen.topk_ids[1:] + s.gen.topk_ids[-1:]
        s.gen.topk_logp = s.gen.topk_logp[1:] + s.gen.topk_logp[-1:]
    path = tmp_path / "shifted.parquet"
    write_rollouts(path, samples, {})
    refused(path, r"row 1, token 0: sampled token \d+ has behaviour log-prob .* but its top-K entry")


def test_positive_behaviour_logp_is_refused(tmp_path):
    samples = make_samples()
    samples[3].gen.logp[1] = 0.5
    path = tmp_path / "plus.parquet"
    write_rollouts(path, samples, {})
    refused(path, r"row 3, token 1: behaviour log-prob 0.5 is not a log-probability")


def test_tolerance_admits_rounding_above_zero(tmp_path):
    samples = make_samples(vocab=2, k=2, rows=1)
    samples[0].gen.logp[0] = samples[0].gen.topk_logp[0][0] = 5e-7
    samples[0].gen.topk_ids[0] = [samples[0].gen.response_ids[0], 1 - samples[0].gen.response_ids[0]]
    path = tmp_path / "r.parquet"
    write_rollouts(path, samples, {})
    read_rollouts(path)


@pytest.mark.parametrize("where", ["behaviour", "topk", "advantage", "reward"])
def test_nan_is_refused(tmp_path, where):
    samples = make_samples()
    if where == "behaviour":
        samples[2].gen.logp[0] = math.nan
    elif where == "topk":
        samples[2].gen.topk_logp[0][3] = math.nan
    else:
        setattr(samples[2], where, math.nan)
    path = tmp_path / "nan.parquet"
    with pytest.raises(DataError, match="the batch is not written"):
        write_rollouts(path, samples, {})
    assert not path.exists()
    write_rollouts(path, samples, {}, check=False)  # a file masktrl would not write: the reader refuses it too
    refused(path, r"row 2" + (", token 0" if where in ("behaviour", "topk") else f": {where} is nan"))


@pytest.mark.parametrize(
    "column, array, match",
    [
        (
            "behavior_logp",
            lambda s: pa.array([s.gen.logp for s in s], pa.list_(pa.float64())),
            "column behavior_logp has type list<double>, expected list<float>",
        ),
        ("reward", lambda s: pa.array([str(x.reward) for x in s]), "column reward has type string, expected double"),
        (
            "topk_ids",
            lambda s: pa.array([x.gen.response_ids for x in s], pa.list_(pa.int32())),
            "column topk_ids has type list<int32>, expected list<list<int32>>",
        ),
        (
            "advantage",
            lambda s: pa.array([None] + [x.advantage for x in s[1:]], pa.float64()),
            "row 0: null value in column advantage",
        ),
        (
            "response_ids",
            lambda s: pa.array([x.gen.response_ids[:-1] + [None] for x in s], pa.list_(pa.int32())),
            "row 0: null value in column response_ids",
        ),
    ],
)
def test_wrong_column_types_and_nulls_are_refused(tmp_path, column, array, match):
    samples = make_samples()
    path = tmp_path / "bad.parquet"
    write_v1_table(path, samples, **{column: array(samples)})
    refused(path, match)


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / "r.parquet"
    write_rollouts(path, make_samples(), {})
    path.write_bytes(path.read_bytes()[:-100])
    refused(path, "unreadable rollout parquet")


def test_ragged_topk_width_is_refused(tmp_path):
    samples = make_samples(vocab=17, k=17)
    samples[4].gen.topk_ids[2] = samples[4].gen.topk_ids[2][:-1]
    samples[4].gen.topk_logp[2] = samples[4].gen.topk_logp[2][:-1]
    path = tmp_path / "r.parquet"
    write_rollouts(path, samples, {})
    refused(path, r"row 4, token 2: top-K list has 16 entries, the file's first has 17")
    samples[4].gen.topk_ids[2].append(3)
    write_rollouts(path, samples, {})
    refused(path, r"row 4, token 2: 16 top-K log-probs for 17 top-K ids")


def test_ids_outside_the_vocabulary_are_refused(tmp_path):
    samples = make_samples(vocab=50, k=8)
    path = tmp_path / "r.parquet"
    write_rollouts(path, samples, {})
    read_rollouts(path, vocab_size=50)
    refused(path, r"outside the vocabulary \[0, 40\)", vocab_size=40)
    samples[1].gen.topk_ids[0][5] = -7
    write_rollouts(path, samples, {})
    refused(path, r"row 1, token 0: top-K id -7 outside the vocabulary")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda g: g.topk_logp[0].reverse(), "not in descending order"),
        (lambda g: g.topk_ids[0].__setitem__(3, g.topk_ids[0][2]), "names id .* twice"),
        (lambda g: g.topk_ids[0].__setitem__(3, -1), "pad id -1 .* pads are -inf"),
        (lambda g: g.topk_logp[0].__setitem__(0, INF), "top-K log-prob inf .* is not a log-probability"),
    ],
)
def test_inconsistent_topk_lists_are_refused(tmp_path, edit, match):
    samples = make_samples(vocab=50, k=8)
    edit(samples[5].gen)
    path = tmp_path / "r.parquet"
    write_rollouts(path, samples, {})
    refused(path, r"row 5, token 0: .*" + match)


@pytest.mark.parametrize(
    "column, values, match",
    [
        ("sampled_rank", lambda v: [[99] + r[1:] for r in v], "sampled_rank 99 outside"),
        ("topk_vocab", lambda v: [r[:3] for r in v], "outside the file's id table"),
        ("topk_logp_x", lambda v: [[10**6]] + v[1:], "topk_logp_x index 1000000 outside the row"),
        ("response_ids_x", lambda v: [r + [1] for r in v], "response_ids_x holds"),
        ("topk_logp", lambda v: [r[:-1] for r in v], "topk_logp holds"),
    ],
)
def test_corrupt_format2_encodings_are_refused(tmp_path, column, values, match):
    path = tmp_path / "r.parquet"
    write_rollouts(path, make_samples(vocab=17, k=8, rows=12), {})
    assert codec(path)["topk_ids"] == "vocab"
    table = pq.read_table(path)
    i = table.column_names.index(column)
    table = table.set_column(
        i, column, pa.array(values(table.column(column).to_pylist()), table.schema.field(column).type)
    )
    pq.write_table(table, path)
    refused(path, match)


def test_unknown_format_is_refused(tmp_path):
    path = tmp_path / "r.parquet"
    write_rollouts(path, make_samples(), {})
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, storage.CODEC_KEY: b'{"format": 7}'}), path)
    refused(path, r"unknown rollout file format 7")


def test_damaged_bytes_never_escape_as_a_traceback(tmp_path):
    """Seeded bit flips anywhere in a format-2 file: the read succeeds (the flip missed every number
    or left plausible ones: the manifest hash, not the reader, catches those) or fails in one line."""
    path = tmp_path / "r.parquet"
    write_rollouts(path, make_samples(vocab=17, k=8, rows=12), {"step": 1})
    data = path.read_bytes()
    rng = np.random.default_rng(0)
    for trial in range(60):
        damaged = bytearray(data)
        for at in rng.integers(0, len(data), 1 + trial % 4):
            damaged[at] ^= 1 << int(rng.integers(0, 8))
        path.write_bytes(bytes(damaged))
        try:
            read_rollouts(path)
        except ArtifactError as exc:
            assert "\n" not in str(exc) and str(path) in str(exc)
