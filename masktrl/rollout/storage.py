"""Rollout batches on disk: one parquet row per sampled response (docs/ROLLOUTS.md).

Format 2 (written now) stores every number the methods read -- response ids, behaviour
log-probabilities, top-K ids and log-probabilities -- bit-exactly, in fewer bytes:

* the sampled token is stored as its index in the top-K list (``sampled_rank``) when the list
  holds it with the same log-probability, else (``-1``) as an exception (``*_x`` columns);
* top-K ids are ranks into a per-file table of the distinct ids by descending count
  (``topk_vocab``, row 0) when ids repeat enough for that to pay, else the raw ids;
* top-K log-probabilities are stored as the first entry of each list followed by steps
  ``e_j`` with ``fl(lp[j-1] + e_j) == lp[j]`` in float32, each step rounded to bf16 precision
  where that still gives the same bit pattern back; an entry no step reproduces is stored
  raw and its index listed in ``topk_logp_x``;
* zstd over byte-stream-split floats and ints.

Format 1 (the previous schema, nested lists, no compression) is still read. A file without
the ``masktrl.codec`` metadata key is format 1. Whatever the format, a file is validated row by
row after decoding (``validate``) and any problem is one ``ArtifactError`` line naming the file,
the row and, for per-token problems, the token.
"""

from __future__ import annotations

import gc
import io
import json
import re
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from masktrl.errors import ArtifactError, DataError
from masktrl.io import atomic_write_bytes
from masktrl.readers import load_json
from masktrl.rollout.base import Generation, Sample

FORMAT = 2
CODEC_KEY = b"masktrl.codec"  # JSON {"format", "k", "topk_ids"}; absent in format-1 files
# log-probabilities may exceed 0 by this much: float32 log_softmax of a near-certain token is
# -log(sum(exp(z - max))) with sum >= 1, i.e. <= 0 exactly with a correctly rounded log, but GPU
# kernels compute log/exp to a few ulp; 1e-6 is ~8 ulp of 1.0 and far below any real error (+0.5).
LOGP_TOLERANCE = 1e-6
ROW_COLUMNS = [
    ("example_id", pa.string()),
    ("prompt", pa.string()),
    ("answer", pa.string()),
    ("group", pa.int32()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("finished", pa.bool_()),
    ("text", pa.string()),
    ("reward", pa.float64()),
    ("advantage", pa.float64()),
]
SCHEMA_V1 = pa.schema(
    ROW_COLUMNS[:5]
    + [
        ("response_ids", pa.list_(pa.int32())),
        ("behavior_logp", pa.list_(pa.float32())),
        ("topk_ids", pa.list_(pa.list_(pa.int32()))),
        ("topk_logp", pa.list_(pa.list_(pa.float32()))),
    ]
    + ROW_COLUMNS[5:]
)
SCHEMA = pa.schema(
    ROW_COLUMNS
    + [
        ("sampled_rank", pa.list_(pa.int16())),  # [T] index into the top-K list; -1: in the *_x columns
        ("response_ids_x", pa.list_(pa.int32())),  # sampled ids where sampled_rank == -1, in order
        ("behavior_logp_x", pa.list_(pa.float32())),  # their log-probabilities
        ("topk_ids", pa.list_(pa.int32())),  # [T*K] raw ids, or ranks into topk_vocab
        ("topk_vocab", pa.list_(pa.int32())),  # row 0: distinct top-K ids by descending count
        ("topk_logp", pa.list_(pa.float32())),  # [T*K] first entry, then steps (see above)
        ("topk_logp_x", pa.list_(pa.int32())),  # indices into the row's [T*K] stored raw
    ]
)
SCHEMAS = {1: SCHEMA_V1, 2: SCHEMA}
KEPT = (
    "kept",
    pa.list_(pa.int16()),
)  # optional, any format: [T] kept-set sizes of truncated sampling (Generation.kept)
# optional, any format, written only for multi-turn batches (the files of single-turn runs are unchanged):
# [T] each token's source (0 policy, 1 environment: Generation.source) and turn index (Generation.turn)
SOURCE = ("source", pa.list_(pa.int8()))
TURN = ("turn", pa.list_(pa.int16()))
ROUTING = (
    "routing",
    pa.list_(pa.list_(pa.int16())),
)  # optional, any format: [P+T][L*k] the engine's experts (Generation.routing)
VERSION = (
    "version",
    pa.list_(pa.int32()),
)  # optional, any format: [T] each token's policy version (Generation.version; rollout.partial)
_TOKEN_FLOATS = ["behavior_logp_x", "topk_logp"]


@dataclass
class TokenArrays:
    """A batch's per-token numbers, flat: row r owns tokens ``offsets[r]:offsets[r + 1]``."""

    offsets: np.ndarray  # [R + 1] int64
    response_ids: np.ndarray  # [N] int64
    behavior_logp: np.ndarray  # [N] float32
    topk_ids: np.ndarray  # [N, K] int32
    topk_logp: np.ndarray  # [N, K] float32


# --------------------------------------------------------------------------- writing


def write_rollouts(
    path: Path,
    samples: list[Sample],
    meta: dict,
    *,
    compression_level: int | None = None,
    fmt: int = FORMAT,
    layout: str | None = None,
    check: bool = True,
) -> None:
    """Write ``samples`` with ``meta`` (JSON, key ``masktrl``) atomically to ``path``.

    A batch holding a reward or an advantage that is not finite, or a NaN log-probability, is
    refused before anything is written (``check_finite``); ``check=False`` writes it anyway (to
    test the readers on such files).

    ``compression_level``: zstd level of the two top-K columns (the bulk of the file; the small
    columns get level 1); default 6 from 4,096 tokens a batch, else 3, because zstd's start-up
    cost at levels above 3 outweighs their gain on a small batch (tiny default: 5.8 ms vs 1.5 ms
    for 2% fewer bytes). Top-K lists of unequal widths cannot be stored in format 2; such a
    batch is written in format 1, unchanged, and refused when read.
    """
    rows = {
        name: [getattr(s, name) for s in samples]
        for name in ("example_id", "prompt", "answer", "group", "prompt_ids", "text", "reward", "advantage")
    }
    rows["finished"] = [s.gen.finished for s in samples]
    kept = per_token_column(samples, "kept", KEPT[1])
    arrays = token_arrays(samples) if fmt == 2 else None
    if check:
        check_finite(path, rows, arrays)  # a batch is stored only if every number in it is what it claims
    if arrays is None:
        table, codec, opts = _encode_v1(samples, rows), None, {"compression": "none"}
    else:
        cols, codec = encode_tokens(arrays, layout)
        table = pa.table({**rows, **cols}, schema=SCHEMA)
        level = compression_level or (6 if len(arrays.response_ids) >= 4096 else 3)
        opts = {
            "compression": "zstd",
            "compression_level": {_leaf(c): level if c in ("topk_ids", "topk_logp") else 1 for c in SCHEMA.names},
            # zstd finds the repeats too, and sooner: dictionaries made the tiny batch slower and larger
            "use_dictionary": False,
            "column_encoding": {
                f"{c}.list.element": "BYTE_STREAM_SPLIT"
                for c in ("topk_ids", "topk_logp", "topk_vocab", "behavior_logp_x")
            },
        }
    if (
        kept is not None
    ):  # truncated sampling: one more column, absent otherwise (the files of untruncated runs are unchanged)
        table = table.append_column(pa.field(*KEPT), kept)
        if arrays is not None:
            opts["compression_level"]["kept"] = 1
    for spec, col in turn_columns(samples):  # multi-turn batches only
        table = table.append_column(pa.field(*spec), col)
        if arrays is not None:
            opts["compression_level"][spec[0]] = 1
    routing = routing_column(samples)
    if routing is not None:  # routing replay: one more column, absent otherwise (other files unchanged)
        table = table.append_column(pa.field(*ROUTING), routing)
        if arrays is not None:
            opts["compression_level"]["routing"] = 3
    version = per_token_column(samples, "version", VERSION[1])
    if version is not None:  # partial rollouts: one more column, absent otherwise (other files unchanged)
        table = table.append_column(pa.field(*VERSION), version)
        if arrays is not None:
            cast(dict, opts["compression_level"])["version"] = 1
    meta_kv = {b"masktrl": json.dumps(meta, sort_keys=True).encode()}
    if codec:
        meta_kv[CODEC_KEY] = json.dumps(codec, sort_keys=True).encode()
    buf = io.BytesIO()
    if codec is None:
        pq.write_table(table.replace_schema_metadata(meta_kv), buf, write_statistics=False, **opts)
    else:  # without the serialised Arrow schema (~1 KB a file): the parquet types read back as SCHEMA
        with pq.ParquetWriter(buf, table.schema, write_statistics=False, store_schema=False, **opts) as writer:
            writer.write_table(table)
            writer.add_key_value_metadata(meta_kv)
    atomic_write_bytes(path, buf.getvalue())


def per_token_column(samples: list[Sample], attr: str, type_: pa.DataType) -> pa.Array | None:
    """An optional per-token column from ``Generation.<attr>`` (``kept``, ``version``): None when no
    sample records it; ValueError when only some do (a batch is sampled with one setting) or a
    list's length differs from the response's."""
    values = [getattr(s.gen, attr) for s in samples]
    if all(v is None for v in values):
        return None
    if any(v is None or len(v) != len(s.gen.response_ids) for v, s in zip(values, samples)):
        raise ValueError(f"Generation.{attr} must be given for every sample of a batch, one per response token")
    return pa.array(values, type=type_)


def turn_columns(samples: list[Sample]) -> list[tuple[tuple, pa.Array]]:
    """The optional ``source`` and ``turn`` columns: none when every sample is single-turn
    (``Generation.source`` None); a single-turn sample of a multi-turn batch is stored as all
    policy tokens of turn 0. ValueError when a list's length differs from the response's."""
    if all(s.gen.source is None for s in samples):
        return []
    source, turn = [], []
    for s in samples:
        n = len(s.gen.response_ids)
        src = s.gen.source if s.gen.source is not None else [0] * n
        trn = s.gen.turn if s.gen.turn is not None else [0] * n
        if len(src) != n or len(trn) != n:
            raise ValueError("Generation.source and Generation.turn must hold one entry per response token")
        source.append(src)
        turn.append(trn)
    return [(SOURCE, pa.array(source, type=SOURCE[1])), (TURN, pa.array(turn, type=TURN[1]))]


def routing_column(samples: list[Sample]) -> pa.Array | None:
    """The optional ``routing`` column: None when no sample records its routing; ValueError when
    only some do, or a sample's routing has not one row per prompt and response token."""
    rec = [s.gen.routing for s in samples]
    if all(r is None for r in rec):
        return None
    if any(r is None or len(r) != len(s.prompt_ids) + len(s.gen.response_ids) for r, s in zip(rec, samples)):
        raise ValueError(
            "Generation.routing must be given for every sample of a batch, one row per prompt and response token"
        )
    return pa.array(rec, type=ROUTING[1])


def per_token_values(path: Path, table: pa.Table, a: TokenArrays, column: tuple, unit: str = "entry") -> np.ndarray:
    """The flat [N] int64 values of the per-token list column ``column`` (name, type), checked:
    its type, no nulls, and one ``unit`` per response token (the offsets of the response ids)."""
    name, typ = column
    col = table.column(name).combine_chunks()
    if col.type != typ or col.null_count:
        raise ArtifactError(
            f"{path}: column {name} has type {_type_name(col.type)} or nulls, expected {_type_name(typ)}"
        )
    if not np.array_equal(np.asarray(col.offsets), a.offsets):
        raise ArtifactError(f"{path}: column {name} does not hold one {unit} per response token")
    return np.asarray(col.flatten()).astype(np.int64)


def read_versions(path: Path, table: pa.Table, a: TokenArrays) -> list[int] | None:
    """The flat [N] policy versions of the optional ``version`` column (None without it: runs
    without rollout.partial, and every file written before it existed), checked: one per token,
    each >= 0."""
    if VERSION[0] not in table.column_names:
        return None
    values = per_token_values(path, table, a, VERSION)
    bad = np.flatnonzero(values < 0)
    if len(bad):
        raise ArtifactError(f"{path}: {_where(a.offsets, int(bad[0]))}: policy version {values[bad[0]]} is negative")
    return values.tolist()


def has_routing_column(path: Path) -> bool:
    """Whether the rollout file at ``path`` has the ``routing`` column (its schema only)."""
    try:
        return ROUTING[0] in pq.ParquetFile(path).schema_arrow.names
    except (OSError, ValueError, pa.ArrowException):
        return False


def read_routing(path: Path, table: pa.Table) -> list | None:
    """Each row's [P+T][L*k] recorded experts (None without the column: files written without
    routing replay, and every file written before it existed), checked: one row per prompt and
    response token, one width, no negative id."""
    if ROUTING[0] not in table.column_names:
        return None
    col = table.column(ROUTING[0]).combine_chunks()
    if col.type != ROUTING[1] or col.null_count or col.flatten().null_count:
        raise ArtifactError(
            f"{path}: column routing has type {_type_name(col.type)} or nulls, expected {_type_name(ROUTING[1])}"
        )
    rows = col.to_pylist()
    if len({len(pos) for r in rows for pos in r}) > 1 or any(x < 0 for r in rows for pos in r for x in pos):
        raise ArtifactError(f"{path}: column routing holds rows of unequal widths or negative expert ids")
    return rows  # one row per prompt and response token: checked against the samples by read_rollouts


def check_finite(path: Path, rows: dict, arrays: TokenArrays | None) -> None:
    """Refuse to write a batch holding a reward or advantage that is not finite, or a behaviour
    log-probability that is NaN (``DataError`` naming the file and the first such row): what a
    reader would refuse (``validate``) is never written."""
    for name in ("reward", "advantage"):
        values = np.asarray(rows[name], dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            raise DataError(f"{path}: row {int(bad[0])}: {name} is {values[bad[0]]}; the batch is not written")
    if arrays is not None:
        for what, values in (("behaviour log-prob", arrays.behavior_logp), ("top-K log-prob", arrays.topk_logp)):
            bad = np.flatnonzero(np.isnan(values).reshape(len(values), -1).any(axis=1)) if values.size else []
            if len(bad):
                raise DataError(
                    f"{path}: {_where(arrays.offsets, int(bad[0]))}: a {what} is NaN; the batch is not written"
                )


def _leaf(column: str) -> str:
    """The parquet path of ``column``'s values."""
    return f"{column}.list.element" if pa.types.is_list(SCHEMA.field(column).type) else column


def _encode_v1(samples: list[Sample], rows: dict) -> pa.Table:
    cols = {
        "response_ids": [s.gen.response_ids for s in samples],
        "behavior_logp": [s.gen.logp for s in samples],
        "topk_ids": [s.gen.topk_ids for s in samples],
        "topk_logp": [s.gen.topk_logp for s in samples],
    }
    return pa.table({**rows, **cols}, schema=SCHEMA_V1)


def token_arrays(samples: list[Sample]) -> TokenArrays | None:
    """The batch's per-token numbers as arrays; None when its top-K lists are ragged."""
    lengths = [len(s.gen.response_ids) for s in samples]
    if any(
        len(s.gen.logp) != n or len(s.gen.topk_ids) != n or len(s.gen.topk_logp) != n for s, n in zip(samples, lengths)
    ):
        return None
    top_ids = list(chain.from_iterable(s.gen.topk_ids for s in samples))
    top_lp = list(chain.from_iterable(s.gen.topk_logp for s in samples))
    n = len(top_ids)
    k = len(top_ids[0]) if n else 0
    if (
        n
        and not min(map(len, top_ids)) == max(map(len, top_ids)) == min(map(len, top_lp)) == max(map(len, top_lp)) == k
    ):
        return None  # ragged lists
    try:
        tid = np.fromiter(chain.from_iterable(top_ids), np.int32, count=n * k).reshape(n, k)
    except (ValueError, OverflowError):  # an id beyond int32
        return None
    tlp = np.fromiter(chain.from_iterable(top_lp), np.float32, count=n * k).reshape(n, k)
    return TokenArrays(
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        response_ids=np.fromiter(chain.from_iterable(s.gen.response_ids for s in samples), np.int64, count=n),
        behavior_logp=np.fromiter(chain.from_iterable(s.gen.logp for s in samples), np.float32, count=n),
        topk_ids=tid,
        topk_logp=tlp,
    )


def encode_tokens(a: TokenArrays, layout: str | None = None) -> tuple[dict[str, pa.Array], dict]:
    """Format-2 columns (one list per row) and the codec record of ``a``; lossless.

    ``layout``: order of a row's top-K values, "tk" (token-major, as in memory) or "kt"
    (rank-major: all first entries of the row, then all second entries...: values of one rank
    are alike, which compresses better once rows are long); default "kt" from 32 tokens a row.
    """
    n, k = a.topk_ids.shape
    rows = len(a.offsets) - 1
    layout = layout or ("kt" if n >= 32 * rows else "tk")
    slots = kt_slots(a.offsets, k) if layout == "kt" else None
    bits = a.topk_logp.view(np.uint32)
    hit = (a.topk_ids == a.response_ids[:, None]) & (bits == a.behavior_logp.view(np.uint32)[:, None])  # [N, K]
    rank = np.where(hit.any(axis=1), hit.argmax(axis=1) if k else 0, -1).astype(np.int16)  # [N]
    exc = rank < 0
    flat_ids = a.topk_ids.reshape(-1)
    table = id_table(flat_ids)
    stored_ids, vocab = table if table else (flat_ids, np.zeros(0, np.int32))
    steps, raw = logp_steps(a.topk_logp)  # [N, K] each
    off = a.offsets
    exc_off = np.concatenate([[0], np.cumsum(exc)])[off]
    raw_flat = np.flatnonzero(raw)
    raw_row = np.searchsorted(off * k, raw_flat, side="right") - 1 if k else raw_flat
    raw_off = np.searchsorted(raw_flat, off * k)
    vocab_off = np.zeros(rows + 1, np.int64)
    vocab_off[1:] = len(vocab) if rows else 0
    per_token, per_entry = pa.array(off.astype(np.int32)), pa.array((off * k).astype(np.int32))
    cols = {
        "sampled_rank": _lists(per_token, rank),
        "response_ids_x": _lists(exc_off, a.response_ids[exc].astype(np.int32)),
        "behavior_logp_x": _lists(exc_off, a.behavior_logp[exc]),
        "topk_ids": _lists(per_entry, _rank_major(stored_ids, slots)),
        "topk_vocab": _lists(vocab_off, vocab),
        "topk_logp": _lists(per_entry, _rank_major(steps.reshape(-1), slots)),
        "topk_logp_x": _lists(raw_off, (raw_flat - off[raw_row] * k).astype(np.int32)),
    }
    return cols, {"format": FORMAT, "k": int(k), "topk_ids": "vocab" if table else "raw", "layout": layout}


def kt_slots(offsets: np.ndarray, k: int) -> np.ndarray:
    """[N * K] rank-major slot of each token-major entry: row r's (t, j) goes to slot j * T_r + t."""
    lengths = np.diff(offsets)
    row = np.repeat(np.arange(len(lengths)), lengths)  # [N]
    base = offsets[row] * k + np.arange(offsets[-1]) - offsets[row]  # row start + t
    return (base[:, None] + lengths[row][:, None] * np.arange(k)).reshape(-1)  # [N, K] -> flat


def _rank_major(values: np.ndarray, slots: np.ndarray | None) -> np.ndarray:
    if slots is None:
        return values
    out = np.empty_like(values)
    out[slots] = values
    return out


def id_table(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(ranks, vocab) with ``vocab[ranks] == ids`` and vocab ordered by descending count, so
    frequent ids get small ranks; None when ids repeat too little (< 4 uses each on average)
    for the table to pay for itself."""
    if not ids.size:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    if hi - lo < 1 << 24:  # counting is O(N + range), sorting O(N log N)
        counts = np.bincount(ids - lo)
        values = np.flatnonzero(counts)
        counts = counts[values]
    else:
        values, counts = np.unique(ids - lo, return_counts=True)
    if 4 * len(values) > ids.size:
        return None
    by_count = np.argsort(-counts, kind="stable")
    vocab = values[by_count]
    if hi - lo < 1 << 24:
        lut = np.empty(hi - lo + 1, np.int32)
        lut[vocab] = np.arange(len(vocab), dtype=np.int32)
        ranks = lut[ids - lo]
    else:
        ranks = np.argsort(by_count).astype(np.int32)[np.searchsorted(values, ids - lo)]
    return ranks, (vocab + lo).astype(np.int32)


def _lists(offsets: np.ndarray | pa.Array, values: np.ndarray) -> pa.ListArray:
    offsets = offsets if isinstance(offsets, pa.Array) else pa.array(offsets.astype(np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values))


def logp_steps(lp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(steps, raw) for float32 lists ``lp`` [N, K]: ``steps[:, 0] = lp[:, 0]`` and, for j >= 1,
    ``fl(lp[:, j-1] + steps[:, j]) == lp[:, j]`` bit for bit, except where ``raw`` is set
    (``steps`` then holds ``lp`` itself). A step is rounded to bf16 precision (16 fewer mantissa
    bits) where that still gives ``lp[:, j]`` back; rounding by 8, 12 or 20 bits measured no smaller."""
    prev, cur = lp[:, :-1], lp[:, 1:]
    target = cur.view(np.uint32)
    with np.errstate(all="ignore"):
        step = np.where(prev.view(np.uint32) == target, np.float32(0), cur - prev).astype(np.float32)  # -inf, -inf -> 0
        ok = (prev + step).view(np.uint32) == target
        # the step rounded to bf16 precision (two zero low bytes, free after byte-stream-split + zstd)
        short = ((step.view(np.uint32) + np.uint32(0x8000)) & np.uint32(0xFFFF0000)).view(np.float32)
        good = (prev + short).view(np.uint32) == target
        step = np.where(good, short, step)
        ok |= good
    steps = np.concatenate([lp[:, :1], np.where(ok, step, cur)], axis=1)
    raw = np.concatenate([np.zeros((len(lp), min(1, lp.shape[1])), bool), ~ok], axis=1)
    return steps, raw


def logp_from_steps(steps: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """Inverse of ``logp_steps``: the float32 sums, in order, restarted at raw entries."""
    lp = steps.copy()
    with np.errstate(all="ignore"):
        for j in range(1, steps.shape[1]):
            lp[:, j] = np.where(raw[:, j], steps[:, j], lp[:, j - 1] + steps[:, j])
    return lp


# --------------------------------------------------------------------------- reading


def read_rollouts(path: Path, vocab_size: int | None = None) -> tuple[list[Sample], dict]:
    """(samples, meta) of a rollout file, validated (``validate``); any problem is one
    ``ArtifactError`` line. ``vocab_size``: also check every id is below it."""
    path = Path(path)
    try:
        table = pq.ParquetFile(path).read(use_threads=False)  # ~3x faster than read_table on a step's batch
    except (OSError, ValueError, pa.ArrowException) as exc:  # ValueError: e.g. a damaged footer's column names
        raise ArtifactError(f"{path}: unreadable rollout parquet ({str(exc).splitlines()[0]})") from None
    kv = table.schema.metadata or {}
    try:  # bounded: a deep one recursed until Python's limit
        meta = load_json(kv.get(b"masktrl", b"{}"), f"{path}: metadata", error=ArtifactError, finite=False)
        codec = (
            load_json(kv[CODEC_KEY], f"{path}: codec", error=ArtifactError, finite=False)
            if CODEC_KEY in kv
            else {"format": 1}
        )
    except ArtifactError as exc:
        raise ArtifactError(
            f"{path}: rollout file metadata is not valid JSON ({str(exc).split(': ', 2)[-1]})"
        ) from None
    if not isinstance(meta, dict):  # was "unknown rollout file format 2 (this masktrl reads [1, 2])"
        raise ArtifactError(f"{path}: its metadata (key masktrl) is a {type(meta).__name__}, not a JSON object")
    if not isinstance(codec, dict) or codec.get("format") not in SCHEMAS:
        raise ArtifactError(
            f"{path}: unknown rollout file format "
            f"{codec.get('format') if isinstance(codec, dict) else codec!r} (this masktrl reads "
            f"{sorted(SCHEMAS)})"
        )
    try:
        check_columns(path, table, SCHEMAS[codec["format"]])
        arrays = decode_v1(path, table) if codec["format"] == 1 else decode_v2(path, table, codec)
        validate(path, table, arrays, vocab_size)
        kept = read_kept(path, table, arrays)
        turns = read_turns(path, table, arrays)
        routing = read_routing(path, table)
        versions = read_versions(path, table, arrays)
        samples = to_samples(table, arrays)
        if routing is not None:
            for i, (sample, rec) in enumerate(zip(samples, routing)):
                if len(rec) != len(sample.prompt_ids) + len(sample.gen.response_ids):
                    raise ArtifactError(
                        f"{path}: row {i}: column routing does not hold one row per prompt and response token"
                    )
                sample.gen.routing = rec
        if kept is not None:
            for sample, lo, hi in zip(samples, arrays.offsets[:-1].tolist(), arrays.offsets[1:].tolist()):
                sample.gen.kept = kept[lo:hi]
        if turns is not None:
            for sample, lo, hi in zip(samples, arrays.offsets[:-1].tolist(), arrays.offsets[1:].tolist()):
                sample.gen.source, sample.gen.turn = turns[0][lo:hi], turns[1][lo:hi]
        if versions is not None:
            for sample, lo, hi in zip(samples, arrays.offsets[:-1].tolist(), arrays.offsets[1:].tolist()):
                sample.gen.version = versions[lo:hi]
        return samples, meta
    except (ValueError, IndexError, KeyError, TypeError, pa.ArrowException) as exc:  # a damage no check above names
        raise ArtifactError(
            f"{path}: malformed rollout file ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None


def read_kept(path: Path, table: pa.Table, a: TokenArrays) -> list[int] | None:
    """The flat [N] kept-set sizes of the optional ``kept`` column (None without it: files of
    untruncated sampling, and every file written before the column existed), checked: one per
    token, each in [1, K + 1] (K + 1: a kept set larger than the list, not trainable)."""
    if KEPT[0] not in table.column_names:
        return None
    values = per_token_values(path, table, a, KEPT, unit="size")
    k = a.topk_ids.shape[1]
    bad = np.flatnonzero((values < 1) | (values > k + 1))  # K + 1: more than the list holds
    if len(bad):
        raise ArtifactError(
            f"{path}: {_where(a.offsets, int(bad[0]))}: kept-set size {values[bad[0]]} outside [1, K+1={k + 1}]"
        )
    return values.tolist()


def read_turns(path: Path, table: pa.Table, a: TokenArrays) -> tuple[list[int], list[int]] | None:
    """The flat [N] sources and turn indices of the optional ``source``/``turn`` columns (None
    without them: single-turn files, and every file written before they existed), checked: both
    or neither, one entry per token, sources 0 or 1, turns >= 0, and no behaviour log-probability
    (-inf) at an environment token."""
    present = [c for c in (SOURCE[0], TURN[0]) if c in table.column_names]
    if not present:
        return None
    if len(present) == 1:
        raise ArtifactError(f"{path}: column {present[0]} without column {({SOURCE[0], TURN[0]} - set(present)).pop()}")
    source, turn = (per_token_values(path, table, a, c) for c in (SOURCE, TURN))
    bad = np.flatnonzero((source < 0) | (source > 1))
    if len(bad):
        raise ArtifactError(
            f"{path}: {_where(a.offsets, int(bad[0]))}: source {source[bad[0]]} is neither 0 "
            "(policy) nor 1 (environment)"
        )
    bad = np.flatnonzero(turn < 0)
    if len(bad):
        raise ArtifactError(f"{path}: {_where(a.offsets, int(bad[0]))}: turn {turn[bad[0]]} is negative")
    bad = np.flatnonzero((source == 1) & (a.behavior_logp != -np.inf))
    if len(bad):
        raise ArtifactError(
            f"{path}: {_where(a.offsets, int(bad[0]))}: an environment token has a behaviour "
            f"log-prob ({a.behavior_logp[bad[0]]}); it must be -inf"
        )
    return source.tolist(), turn.tolist()


def check_columns(path: Path, table: pa.Table, schema: pa.Schema) -> None:
    missing = set(schema.names) - set(table.column_names)
    if missing:
        raise ArtifactError(f"{path}: not a masktrl rollout file (missing columns {sorted(missing)})")
    for field in schema:
        col = table.column(field.name)
        if col.type != field.type:
            raise ArtifactError(
                f"{path}: column {field.name} has type {_type_name(col.type)}, expected {_type_name(field.type)}"
            )
        chunk = col.combine_chunks()
        level = 0
        while True:
            if chunk.null_count:
                row = _first_null_row(col.combine_chunks(), level)
                raise ArtifactError(f"{path}: row {row}: null value in column {field.name}")
            if not pa.types.is_list(chunk.type):
                break
            chunk, level = chunk.flatten(), level + 1


def _type_name(t: pa.DataType) -> str:
    return re.sub(r"\b(item|element): ", "", str(t))


def _first_null_row(arr: pa.Array, level: int) -> int:
    """The row holding the first null ``level`` list levels down."""
    index = np.arange(len(arr))
    for _ in range(level):
        lengths = np.asarray(pc.list_value_length(arr).fill_null(0))
        index, arr = np.repeat(index, lengths), arr.flatten()
    return int(index[np.flatnonzero(np.asarray(arr.is_null()))[0]])


def _flat(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [R+1] int64, values) of a list column."""
    arr = table.column(name).combine_chunks()
    lengths = np.asarray(pc.list_value_length(arr), dtype=np.int64)
    return np.concatenate([[0], np.cumsum(lengths)]), np.asarray(arr.flatten())


def decode_v1(path: Path, table: pa.Table) -> TokenArrays:
    off, rid = _flat(table, "response_ids")
    for name in ("behavior_logp", "topk_ids", "topk_logp"):
        other, _ = _flat(table, name)
        if not np.array_equal(other, off):
            row = int(np.flatnonzero(np.diff(other) != np.diff(off))[0])
            raise ArtifactError(
                f"{path}: row {row}: {name} has length {np.diff(other)[row]}, response_ids {np.diff(off)[row]}"
            )
    _, blp = _flat(table, "behavior_logp")
    inner = {}
    for name in ("topk_ids", "topk_logp"):
        outer = table.column(name).combine_chunks().flatten()
        lengths = np.asarray(pc.list_value_length(outer), dtype=np.int64)
        inner[name] = (lengths, np.asarray(outer.flatten()))
    widths, lp_widths = inner["topk_ids"][0], inner["topk_logp"][0]
    k = int(widths[0]) if len(widths) else 0
    bad = np.flatnonzero(widths != k)
    if len(bad):
        raise ArtifactError(
            f"{path}: {_where(off, bad[0])}: top-K list has {widths[bad[0]]} entries, the file's first has {k}"
        )
    bad = np.flatnonzero(lp_widths != k)
    if len(bad):
        raise ArtifactError(f"{path}: {_where(off, bad[0])}: {lp_widths[bad[0]]} top-K log-probs for {k} top-K ids")
    n = len(rid)
    return TokenArrays(
        off, rid.astype(np.int64), blp, inner["topk_ids"][1].reshape(n, k), inner["topk_logp"][1].reshape(n, k)
    )


def decode_v2(path: Path, table: pa.Table, codec: dict) -> TokenArrays:
    k, kind, layout = codec.get("k"), codec.get("topk_ids"), codec.get("layout", "tk")
    if not isinstance(k, int) or k < 0 or kind not in ("raw", "vocab") or layout not in ("tk", "kt"):
        raise ArtifactError(f"{path}: bad codec record {codec}")
    flat = {
        name: _flat(table, name)
        for name in (
            "sampled_rank",
            "response_ids_x",
            "behavior_logp_x",
            "topk_ids",
            "topk_vocab",
            "topk_logp",
            "topk_logp_x",
        )
    }
    off, rank = flat["sampled_rank"]
    n = int(off[-1])
    for name in ("topk_ids", "topk_logp"):
        other = flat[name][0]
        bad = np.flatnonzero(other != off * k)
        if len(bad):
            row = int(bad[0]) - 1
            raise ArtifactError(
                f"{path}: row {row}: {name} holds {np.diff(other)[row]} entries for "
                f"{np.diff(off)[row]} tokens x K = {k}"
            )
    bad = np.flatnonzero((rank < -1) | (rank >= k))
    if len(bad):
        raise ArtifactError(f"{path}: {_where(off, bad[0])}: sampled_rank {rank[bad[0]]} outside [-1, {k})")
    exc = rank < 0
    want = np.concatenate([[0], np.cumsum(exc)])[off]
    for name in ("response_ids_x", "behavior_logp_x"):
        got = flat[name][0]
        bad = np.flatnonzero(got != want)
        if len(bad):
            row = int(bad[0]) - 1
            raise ArtifactError(
                f"{path}: row {row}: {name} holds {np.diff(got)[row]} entries for "
                f"{np.diff(want)[row]} tokens outside the top-K lists"
            )
    stored = flat["topk_ids"][1]
    if kind == "vocab":
        vocab = flat["topk_vocab"][1]
        bad = np.flatnonzero((stored < 0) | (stored >= len(vocab)))
        if len(bad):
            raise ArtifactError(
                f"{path}: {_where(off, bad[0] // max(k, 1))}: top-K id rank {stored[bad[0]]} "
                "outside "
                f"the file's id table ({len(vocab)} ids)"
            )
        stored = vocab[stored]
    slots = kt_slots(off, k) if layout == "kt" else None
    tid = (stored if slots is None else stored[slots]).reshape(n, k)
    raw_off, raw_idx = flat["topk_logp_x"]
    raw_row = np.repeat(np.arange(len(off) - 1), np.diff(raw_off))
    bad = np.flatnonzero((raw_idx < 0) | (raw_idx >= np.diff(off)[raw_row] * k))
    if len(bad):
        raise ArtifactError(f"{path}: row {raw_row[bad[0]]}: topk_logp_x index {raw_idx[bad[0]]} outside the row")
    raw = np.zeros(n * k, bool)
    raw[off[raw_row] * k + raw_idx] = True
    steps = flat["topk_logp"][1]
    tlp = logp_from_steps((steps if slots is None else steps[slots]).reshape(n, k), raw.reshape(n, k))
    xid, xlp = flat["response_ids_x"][1], flat["behavior_logp_x"][1]
    rid, blp = np.empty(n, np.int64), np.empty(n, np.float32)
    at = np.flatnonzero(~exc)
    rid[at], blp[at] = tid[at, rank[at]], tlp[at, rank[at]]
    rid[exc], blp[exc] = xid, xlp
    return TokenArrays(off, rid, blp, tid, tlp)


def _where(offsets: np.ndarray, token: int) -> str:
    """ "row R, token T" of the flat token index ``token``."""
    row = int(np.searchsorted(offsets, token, side="right")) - 1
    return f"row {row}, token {int(token - offsets[row])}"


def validate(path: Path, table: pa.Table, a: TokenArrays, vocab_size: int | None = None) -> None:
    """Refuse, in one line naming the file, row and token, a batch no engine could have made.

    Per token: behaviour and top-K log-probabilities are -inf or finite and <= LOGP_TOLERANCE;
    every top-K list is in descending order (both engines sort it; the comparison is exact);
    a top-K list names no id twice, pads (-1) only at -inf; the sampled token's log-prob equals
    its top-K entry where the list holds it (exact: both engines read the two from one tensor);
    ids lie in [0, vocab_size) (top-K: -1 too). Per row: reward and advantage are finite.
    List lengths and the common K are checked while decoding.
    """
    off, (n, k) = a.offsets, a.topk_ids.shape
    tok = np.arange(n)

    def first(bad: np.ndarray, what) -> None:
        hits = np.flatnonzero(bad.any(axis=1) if bad.ndim == 2 else bad)
        if len(hits):
            t = int(hits[0])
            j = int(np.flatnonzero(bad[t])[0]) if bad.ndim == 2 else None
            raise ArtifactError(f"{path}: {_where(off, t)}: {what(t, j)}")

    blp, tlp, tid, rid = a.behavior_logp, a.topk_logp, a.topk_ids, a.response_ids
    first(
        np.isnan(blp) | (blp > LOGP_TOLERANCE),
        lambda t, _: f"behaviour log-prob {blp[t]} is not a log-probability (NaN, or > 0 beyond {LOGP_TOLERANCE})",
    )
    first(
        np.isnan(tlp) | (tlp > LOGP_TOLERANCE),
        lambda t, j: (
            f"top-K log-prob {tlp[t, j]} (entry {j}) is not a log-probability (NaN, or > 0 beyond {LOGP_TOLERANCE})"
        ),
    )
    first(
        tlp[:, 1:] > tlp[:, :-1],
        lambda t, j: f"top-K log-probs are not in descending order (entry {j + 1}: {tlp[t, j + 1]} > {tlp[t, j]})",
    )
    top = vocab_size if vocab_size is not None else np.iinfo(np.int64).max
    first((rid < 0) | (rid >= top), lambda t, _: f"response id {rid[t]} outside the vocabulary [0, {vocab_size})")
    first(
        (tid < -1) | (tid >= top),
        lambda t, j: f"top-K id {tid[t, j]} outside the vocabulary [0, {vocab_size}) (or the pad -1)",
    )
    first((tid == -1) & (tlp != -np.inf), lambda t, j: f"pad id -1 (entry {j}) has log-prob {tlp[t, j]}; pads are -inf")
    srt = np.sort(tid, axis=1)
    first((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0), lambda t, j: f"top-K list names id {srt[t, j + 1]} twice")
    hit = tid == rid[:, None]
    has, at = hit.any(axis=1), hit.argmax(axis=1) if k else np.zeros(n, np.int64)
    entry = tlp[tok, at] if k else blp
    first(
        has & (entry != blp),
        lambda t, _: (
            f"sampled token {rid[t]} has behaviour log-prob {blp[t]} but its top-K entry (entry {at[t]}) is {entry[t]}"
        ),
    )
    p_off, prompt_ids = _flat(table, "prompt_ids")
    bad = np.flatnonzero((prompt_ids < 0) | (prompt_ids >= top))
    if len(bad):
        raise ArtifactError(
            f"{path}: row {int(np.searchsorted(p_off, bad[0], side='right')) - 1}: prompt id "
            f"{prompt_ids[bad[0]]} outside the vocabulary [0, {vocab_size})"
        )
    for name in ("reward", "advantage"):
        values = np.asarray(table.column(name).combine_chunks())
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            raise ArtifactError(f"{path}: row {int(bad[0])}: {name} is {values[bad[0]]}")


def to_samples(table: pa.Table, a: TokenArrays) -> list[Sample]:
    """The records, as Python lists. The cyclic garbage collector is paused meanwhile: the ~10^5
    small lists of a batch would set off collections that scan every live object, which took
    longer than building them (none of these lists can be cyclic garbage)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _records(table, a)
    finally:
        if enabled:
            gc.enable()


def _records(table: pa.Table, a: TokenArrays) -> list[Sample]:
    d = {name: table.column(name).to_pylist() for name, _ in ROW_COLUMNS}
    rid, blp, tid, tlp = a.response_ids.tolist(), a.behavior_logp.tolist(), a.topk_ids.tolist(), a.topk_logp.tolist()
    off = a.offsets.tolist()
    samples = []
    for i in range(table.num_rows):
        lo, hi = off[i], off[i + 1]
        gen = Generation(
            response_ids=rid[lo:hi],
            logp=blp[lo:hi],
            topk_ids=tid[lo:hi],
            topk_logp=tlp[lo:hi],
            finished=d["finished"][i],
        )
        samples.append(
            Sample(
                example_id=d["example_id"][i],
                prompt=d["prompt"][i],
                answer=d["answer"][i],
                prompt_ids=d["prompt_ids"][i],
                group=d["group"][i],
                gen=gen,
                text=d["text"][i],
                reward=d["reward"][i],
                advantage=d["advantage"][i],
            )
        )
    return samples
