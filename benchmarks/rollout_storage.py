"""Bytes per generated token, write and read time of a stored rollout batch: format 1 (the
previous schema: nested lists, uncompressed) against format 2 (masktrl/rollout/storage.py).

bytes/token = file size / number of response tokens. Every batch is written in both formats,
read back, and checked bit for bit (ids, and the float32 bit patterns of every behaviour and
top-K log-probability); then write and read are timed alternately, ``--reps`` rounds, medians.
Write time is ``write_rollouts`` as the trainer calls it (encode, parquet, atomic write with
fsync), ``encode ratio`` the same without the disk write; read time is the previous reader
for format 1 and ``read_rollouts`` (decode and row-by-row validation, ``validate ms`` on its
own) for format 2.

Cases, all at K = ``--k`` (20):

* ``tiny``: the tiny default's batches as ``masktrl train`` writes them (17-token vocabulary:
  every top-K list holds all 17 ids), from a ``--tiny-steps``-step run with
  ``warmstart.steps=50``, or from the ``steps/*/rollouts.parquet`` of ``--run``.
* ``synthetic``: ``--rows`` responses x ``--tokens`` tokens over a ``--vocab``-token vocabulary
  (151,936 = Qwen3's). Each position's logits are a Zipf prior over the ids (id of frequency rank
  r: ``-alpha * log(1 + r)``) + N(0, 1) noise + ``--boosts`` heavy-tailed (3 + exponential(10))
  boosts of random "context" ids, the shape of a trained model's logits (a few peaked
  candidates over a frequency-shaped tail); the token is sampled from ``log_softmax(logits)``.
  ``float32``: the logits as drawn; ``bf16``: rounded to bfloat16 and upcast to float32 before
  the log_softmax, as vLLM does with a bf16 model. ``zipf`` uses alpha = 1.2, ``uniform-ids``
  alpha = 0 (every id equally likely in the tail: the worst case for the ids).
  Text is a pseudo-word per id (2-7 letters); groups of 8 responses share a 64-id prompt.

    python benchmarks/rollout_storage.py --json outputs/bench/rollout_storage.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

from common import count, machine, median, parser, print_table, write_json

TARGET = 40.0  # bytes per generated token at K = 20


def main(argv=None) -> dict:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--reps", type=count, default=7, help="timed write/read rounds per case")
    p.add_argument("--k", type=int, default=20)
    p.add_argument(
        "--run", help="measure this run folder's steps/*/rollouts.parquet as the tiny case (default: train one)"
    )
    p.add_argument("--tiny-steps", type=count, default=3)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--level", type=int, default=None, help="zstd level of format 2 (default: write_rollouts' own)")
    p.add_argument("--boosts", type=int, default=4)
    p.add_argument(
        "--cases", nargs="+", default=["tiny", "float32-zipf", "bf16-zipf", "float32-uniform-ids", "bf16-uniform-ids"]
    )
    args = p.parse_args(argv)

    from masktrl.rollout.storage import read_rollouts

    results, synthetic = {}, {}
    level = {} if args.level is None else {"compression_level": args.level}
    with tempfile.TemporaryDirectory(prefix="rollout-storage-") as tmp:
        tmp = Path(tmp)
        for case in args.cases:
            if case == "tiny":
                files = sorted(Path(args.run or tiny_run(tmp, args.tiny_steps)).glob("steps/*/rollouts.parquet"))
                batches = [read_rollouts(f) for f in files]
            else:
                dtype, ids = case.split("-", 1)
                if ids not in synthetic:  # one draw of logits serves the float32 and the bf16 case
                    synthetic[ids] = synthetic_batches(
                        args.rows, args.tokens, args.vocab, args.k, 1.2 if ids == "zipf" else 0.0, args.boosts, seed=0
                    )
                batches = [(synthetic[ids][dtype], {"case": case})]
            results[case] = measure(batches, tmp, args.reps, level)
            results[case]["stats"] = batch_stats(batches)
    report(results)
    out = {"results": results, "target_bytes_per_token": TARGET, "k": args.k, "machine": machine(), "args": vars(args)}
    write_json(args.json, out)
    return out


# --------------------------------------------------------------------------- batches


def tiny_run(tmp: Path, steps: int) -> Path:
    """A ``steps``-step tiny default run (50 warm-start steps), via the CLI."""
    cmd = [
        sys.executable,
        "-c",
        "from masktrl.cli import main; main()",
        "train",
        "--out",
        str(tmp / "out"),
        "--run",
        "tiny",
        "--set",
        "warmstart.steps=50",
        "--set",
        f"train.steps={steps}",
        "--set",
        "task.n_test=32",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return tmp / "out" / "tiny"


def synthetic_batches(
    rows: int, tokens: int, vocab: int, k: int, alpha: float, boosts: int, seed: int
) -> dict[str, list]:
    """{"float32": samples, "bf16": samples}: ``rows`` responses of ``tokens`` tokens each, from one
    draw of logits (see the module docstring), rounded to bfloat16 for the second batch."""
    import torch

    from masktrl.rollout.base import Generation, Sample

    g = torch.Generator().manual_seed(seed)
    prior = -alpha * torch.log1p(torch.randperm(vocab, generator=g).float())  # [V] by frequency rank
    draws = {dtype: torch.Generator().manual_seed(seed + 1) for dtype in ("float32", "bf16")}
    cols = {dtype: ([], [], [], []) for dtype in draws}  # ids, logp, top-K ids, top-K logp
    n = rows * tokens
    for start in range(0, n, 128):
        m = min(128, n - start)
        z = 20.0 + prior + torch.randn((m, vocab), generator=g)  # [m, V]
        z.scatter_add_(
            1,
            torch.randint(0, vocab, (m, boosts), generator=g),
            3.0 - 10.0 * torch.log(torch.rand((m, boosts), generator=g)),
        )
        for dtype, out in cols.items():
            lp = torch.log_softmax(z if dtype == "float32" else z.to(torch.bfloat16).float(), dim=-1)
            v, i = lp.topk(k, dim=-1)
            sampled = torch.multinomial(lp.exp(), 1, generator=draws[dtype])  # [m, 1]
            for part, x in zip(out, (sampled[:, 0], lp.gather(1, sampled)[:, 0], i, v)):
                part.append(x)
    words = word_table(vocab, seed)
    batches = {}
    for dtype, out in cols.items():
        ids, logp = (torch.cat(x).view(rows, tokens).tolist() for x in out[:2])
        top_ids, top_lp = (torch.cat(x).view(rows, tokens, k).tolist() for x in out[2:])
        rng = np.random.default_rng(seed)
        samples = []
        prompt: list[int] = []  # set at r = 0
        for r in range(rows):
            prompt = rng.integers(0, vocab, 64).tolist() if r % 8 == 0 else prompt  # groups of 8 share a prompt
            gen = Generation(ids[r], logp[r], top_ids[r], top_lp[r], finished=bool(r % 3))
            samples.append(
                Sample(
                    f"ex{r // 8}",
                    "".join(words[i] for i in prompt),
                    str(r),
                    prompt,
                    r // 8,
                    gen,
                    text="".join(words[i] for i in ids[r]),
                    reward=float(r % 2),
                    advantage=float(rng.normal()),
                )
            )
        batches[dtype] = samples
    return batches


def word_table(vocab: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz "))
    lengths = rng.integers(2, 8, vocab)
    chars = letters[np.minimum(rng.geometric(0.15, lengths.sum()) - 1, len(letters) - 1)]
    return ["".join(w) for w in np.split(chars, np.cumsum(lengths)[:-1])]


def batch_stats(batches) -> dict:
    """What shapes the sizes: top-1 probability, top-K mass, sampled token in top-K, id entropy."""
    tid = np.array([row for samples, _ in batches for s in samples for row in s.gen.topk_ids])
    tlp = np.array([row for samples, _ in batches for s in samples for row in s.gen.topk_logp], dtype=np.float64)
    rid = np.array([t for samples, _ in batches for s in samples for t in s.gen.response_ids])
    _, counts = np.unique(tid, return_counts=True)
    q = counts / counts.sum()
    return {
        "tokens": int(len(rid)),
        "k": int(tid.shape[1]),
        "top1_prob_mean": float(np.exp(tlp[:, 0]).mean()),
        "topk_mass_mean": float(np.exp(tlp).sum(1).mean()),
        "sampled_in_topk": float((tid == rid[:, None]).any(1).mean()),
        "topk_id_entropy_bits": float(-(q * np.log2(q)).sum()),
    }


# --------------------------------------------------------------------------- measurement


def measure(batches, tmp: Path, reps: int, level: dict) -> dict:
    from masktrl.rollout import storage

    sizes, columns = {1: 0, 2: 0}, {}
    tokens = sum(len(s.gen.response_ids) for samples, _ in batches for s in samples)
    times = {key: [] for key in ("write1", "write2", "encode1", "encode2", "read1", "read2", "validate")}
    for b, (samples, meta) in enumerate(batches):
        for fmt in (1, 2):
            path = tmp / f"b{b}-v{fmt}.parquet"
            storage.write_rollouts(path, samples, meta, fmt=fmt, **(level if fmt == 2 else {}))
            sizes[fmt] += path.stat().st_size
            if fmt == 2:
                for column, size in column_sizes(path).items():
                    columns[column] = columns.get(column, 0) + size
            back = legacy_read(path) if fmt == 1 else storage.read_rollouts(path)[0]
            assert fingerprint(back) == fingerprint(samples), f"format {fmt} did not round-trip bit-exactly"
    for rep in range(reps):
        order = (1, 2) if rep % 2 else (2, 1)  # neither format always runs first
        for b, (samples, meta) in enumerate(batches):
            paths = {fmt: tmp / f"b{b}-v{fmt}.parquet" for fmt in order}
            for fmt in order:
                times[f"write{fmt}"].append(
                    timed(storage.write_rollouts, paths[fmt], samples, meta, fmt=fmt, **(level if fmt == 2 else {}))
                )
            with no_disk(storage):
                for fmt in order:
                    times[f"encode{fmt}"].append(
                        timed(storage.write_rollouts, paths[fmt], samples, meta, fmt=fmt, **(level if fmt == 2 else {}))
                    )
            for fmt in order:
                times[f"read{fmt}"].append(timed(legacy_read if fmt == 1 else storage.read_rollouts, paths[fmt]))
            times["validate"].append(validate_time(paths[2]))
    ms = {key: 1000 * median(v) for key, v in times.items()}
    return {
        "bytes_per_token_v1": sizes[1] / tokens,
        "bytes_per_token_v2": sizes[2] / tokens,
        **{f"{key}_ms": v for key, v in ms.items()},
        "write_ratio": ms["write2"] / ms["write1"],
        "encode_ratio": ms["encode2"] / ms["encode1"],
        "read_ratio": ms["read2"] / ms["read1"],
        "tokens_per_batch": tokens / len(batches),
        "bytes_per_token_v2_by_column": {c: v / tokens for c, v in columns.items()},
    }


def column_sizes(path: Path) -> dict[str, int]:
    """Compressed bytes of each column, and the rest of the file (footer, metadata) as "other"."""
    import pyarrow.parquet as pq

    group = pq.ParquetFile(path).metadata.row_group(0)
    sizes = {
        group.column(i).path_in_schema.split(".")[0]: group.column(i).total_compressed_size
        for i in range(group.num_columns)
    }
    return {**sizes, "other": path.stat().st_size - sum(sizes.values())}


@contextmanager
def no_disk(storage):
    """``write_rollouts`` without the atomic write and fsync: the encoding alone."""
    real = storage.atomic_write_bytes
    storage.atomic_write_bytes = lambda path, data: None
    try:
        yield
    finally:
        storage.atomic_write_bytes = real


def timed(fn, *args, **kw) -> float:
    t0 = time.perf_counter()
    fn(*args, **kw)
    return time.perf_counter() - t0


def validate_time(path: Path) -> float:
    import pyarrow.parquet as pq

    from masktrl.rollout import storage

    table = pq.read_table(path)
    arrays = storage.decode_v2(path, table, json.loads(table.schema.metadata[storage.CODEC_KEY]))
    return timed(storage.validate, path, table, arrays)


def fingerprint(samples) -> list:
    """Everything a sample holds, log-probabilities as float32 bit patterns."""
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


def legacy_read(path: Path) -> list:
    """The format-1 reader as it was before format 2 (no validation): the baseline of read time."""
    import pyarrow.parquet as pq

    from masktrl.rollout.base import Generation, Sample

    d = pq.read_table(path).to_pydict()
    return [
        Sample(
            d["example_id"][i],
            d["prompt"][i],
            d["answer"][i],
            d["prompt_ids"][i],
            d["group"][i],
            Generation(
                d["response_ids"][i], d["behavior_logp"][i], d["topk_ids"][i], d["topk_logp"][i], d["finished"][i]
            ),
            text=d["text"][i],
            reward=d["reward"][i],
            advantage=d["advantage"][i],
        )
        for i in range(len(d["group"]))
    ]


def report(results: dict) -> None:
    rows = []
    for case, r in results.items():
        rows.append(
            [
                case,
                r["tokens_per_batch"],
                r["bytes_per_token_v1"],
                r["bytes_per_token_v2"],
                r["bytes_per_token_v1"] / r["bytes_per_token_v2"],
                r["write1_ms"],
                r["write2_ms"],
                r["write_ratio"],
                r["encode_ratio"],
                r["read1_ms"],
                r["read2_ms"],
                r["read_ratio"],
                r["validate_ms"],
            ]
        )
    print_table(
        f"Rollout storage, format 1 -> 2 (target <= {TARGET:.0f} B/token at K = 20)",
        [
            "case",
            "tokens/batch",
            "B/token v1",
            "B/token v2",
            "smaller",
            "write ms v1",
            "write ms v2",
            "ratio",
            "encode ratio",
            "read ms v1",
            "read ms v2",
            "ratio",
            "validate ms",
        ],
        rows,
    )
    print_table(
        "What shapes the sizes",
        ["case", "top-1 p", "top-K mass", "sampled in top-K", "top-K id entropy (bits)"],
        [
            [
                c,
                r["stats"]["top1_prob_mean"],
                r["stats"]["topk_mass_mean"],
                r["stats"]["sampled_in_topk"],
                r["stats"]["topk_id_entropy_bits"],
            ]
            for c, r in results.items()
        ],
    )


if __name__ == "__main__":
    main()
