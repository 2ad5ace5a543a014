"""Rollout batches on disk: one parquet row per sampled response.

Schema (documented in docs/ROLLOUTS.md):

    example_id str, prompt str, answer str, group int32, prompt_ids list<int32>,
    response_ids list<int32>, behavior_logp list<float32>,
    topk_ids list<list<int32>>, topk_logp list<list<float32>>,
    finished bool, text str, reward float64, advantage float64

File metadata (``masktrl`` key, JSON): engine, logprobs_k, temperature, top_p,
tokenizer hash, step, and anything else the writer passes.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from masktrl.errors import ArtifactError
from masktrl.io import atomic_write_bytes
from masktrl.rollout.base import Generation, Sample

SCHEMA = pa.schema(
    [
        ("example_id", pa.string()),
        ("prompt", pa.string()),
        ("answer", pa.string()),
        ("group", pa.int32()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("behavior_logp", pa.list_(pa.float32())),
        ("topk_ids", pa.list_(pa.list_(pa.int32()))),
        ("topk_logp", pa.list_(pa.list_(pa.float32()))),
        ("finished", pa.bool_()),
        ("text", pa.string()),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
    ]
)


def write_rollouts(path: Path, samples: list[Sample], meta: dict) -> None:
    cols = {
        "example_id": [s.example_id for s in samples],
        "prompt": [s.prompt for s in samples],
        "answer": [s.answer for s in samples],
        "group": [s.group for s in samples],
        "prompt_ids": [s.prompt_ids for s in samples],
        "response_ids": [s.gen.response_ids for s in samples],
        "behavior_logp": [s.gen.logp for s in samples],
        "topk_ids": [s.gen.topk_ids for s in samples],
        "topk_logp": [s.gen.topk_logp for s in samples],
        "finished": [s.gen.finished for s in samples],
        "text": [s.text for s in samples],
        "reward": [s.reward for s in samples],
        "advantage": [s.advantage for s in samples],
    }
    table = pa.table(cols, schema=SCHEMA).replace_schema_metadata({"masktrl": json.dumps(meta, sort_keys=True)})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="none", write_statistics=False)  # small, per step: speed over size
    atomic_write_bytes(path, buf.getvalue())


def read_rollouts(path: Path) -> tuple[list[Sample], dict]:
    path = Path(path)
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise ArtifactError(f"{path}: unreadable rollout parquet ({str(exc).splitlines()[0]})") from None
    missing = set(SCHEMA.names) - set(table.column_names)
    if missing:
        raise ArtifactError(f"{path}: not a masktrl rollout file (missing columns {sorted(missing)})")
    meta_raw = (table.schema.metadata or {}).get(b"masktrl", b"{}")
    meta = json.loads(meta_raw)
    d = table.to_pydict()
    samples = []
    for i in range(table.num_rows):
        gen = Generation(
            response_ids=d["response_ids"][i],
            logp=d["behavior_logp"][i],
            topk_ids=d["topk_ids"][i],
            topk_logp=d["topk_logp"][i],
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
    return samples, meta
