"""Training on rollouts produced elsewhere (``masktrl train --rollouts-from RUN_OR_FILE``).

A run folder supplies its stored batches step by step: the batches its manifest records as
complete (``step/<s>/rollout``), each checked against the sha256 recorded there before the run
starts, so a batch changed after it was written is never trained on. A single parquet file
(from ``masktrl rollout``) is cut into batches of ``prompts_per_step`` groups, in order. A run
that kept only some batches (``rollout.store=resume``) is refused. Every file is validated row
by row when read (``rollout/storage.py``). The tokens, behaviour log-probabilities, rewards and
advantages are used exactly as stored, so methods trained from the same source see identical
data (reward shaping and dynamic sampling belong to the run that produced the rollouts).

The sampling a batch records (its temperature, the engine's ``rollout.dtype`` and
``rollout.quantization``, its group size ``rollout.n`` and list length ``rollout.logprobs_k``)
must be the config's: π is computed at the temperature μ was sampled at, and the run's config
describes its data. A difference is refused with one line naming both
values (``check_sampled_as``), rather than trained on silently or overridden behind the config's
back.
"""

from __future__ import annotations

from pathlib import Path

from masktrl.errors import ArtifactError, ConfigError, MasktrlError
from masktrl.models.loading import tokenizer_fingerprint
from masktrl.rl.collect import Batch, numbered, rollout_stats
from masktrl.rollout.base import check_sampling
from masktrl.rollout.storage import has_routing_column, read_rollouts
from masktrl.runs.store import RunStore, done_steps, is_run_folder, rollout_key

SAMPLED_AS = (
    ("temperature", "rollout.temperature"),
    ("top_p", "rollout.top_p"),
    ("rollout_dtype", "rollout.dtype"),
    ("quantization", "rollout.quantization"),
    ("top_k", "rollout.top_k"),
    ("n", "rollout.n"),
    ("logprobs_k", "rollout.logprobs_k"),
)
"""(the rollout file's metadata field, the config key it must equal): what made mu, what pi is
computed with, and the shape of the data (the group size, the lists' length K, compared as
min(K, vocabulary): the lists a model of a smaller vocabulary stores)."""


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(least: int):
    return lambda v: _number(v) and isinstance(v, int) and v >= least


RECORDED_KINDS = {
    "temperature": ("a number", _number),
    "top_p": ("a number", _number),
    "n": ("an integer >= 1", _count(1)),
    "logprobs_k": ("an integer >= 1", _count(1)),
    "max_new_tokens": ("an integer >= 1", _count(1)),
    "top_k": ("an integer >= 0 or null", lambda v: v is None or _count(0)(v)),
    "rollout_dtype": ("text or null", lambda v: v is None or isinstance(v, str)),
    "quantization": ("text or null", lambda v: v is None or isinstance(v, str)),
    "engine": ("text or null", lambda v: v is None or isinstance(v, str)),
}
"""(what it must be, its check) for each sampling setting a rollout file's metadata records
(docs/ROLLOUTS.md): a file written by another tool is read only if each is what a config key
can hold (a text ``"4"`` for ``n`` was "sampled with rollout.n=4, this config has rollout.n=4";
a text ``top_k`` a ValueError traceback)."""


class RolloutSource:
    """The batches of a run folder or of one rollout file, checked against this model's tokenizer.

    ``steps``: the most batches the run will use (those are verified now); ``vocab_size``: the
    policy's vocabulary, which every token id must lie in."""

    def __init__(
        self, spec: str, prompts_per_step: int, tokenizer, *, vocab_size: int | None = None, steps: int | None = None
    ):
        path = Path(spec)
        self.vocab_size = vocab_size
        self._store = None
        if path.is_dir():
            self._store, self._files = _run_batches(path, steps)
            self._batches = None
        elif path.is_file():
            samples, meta = self._read(path)
            groups: dict[tuple[str, int], list] = {}
            for s in samples:
                groups.setdefault((s.example_id, s.group), []).append(s)
            ordered = list(groups.values())
            self._batches = [ordered[i : i + prompts_per_step] for i in range(0, len(ordered), prompts_per_step)]
            self._files = None
            self._check(meta, tokenizer, path)
            self.meta = {k: v for k, v in meta.items() if k != "stats"}
        else:
            raise MasktrlError(f"--rollouts-from {spec}: no such run folder or parquet file")
        if self._files is not None:
            _, meta = self._read(self._files[0])
            self._check(meta, tokenizer, self._files[0])
            self.meta = {k: v for k, v in meta.items() if k != "stats"}
        self._check_shape(spec, prompts_per_step, steps)

    def _check_shape(self, spec: str, prompts_per_step: int, steps: int | None) -> None:
        """ConfigError, before anything trains, when the replay would not be the run its config
        describes: batches of another size than ``rollout.prompts_per_step``, or fewer batches than
        ``train.steps`` (a replay never stops early without a word)."""
        if self._store is not None:
            theirs = self._store.config().rollout.prompts_per_step
            if theirs != prompts_per_step:
                raise ConfigError(
                    f"--rollouts-from {spec}: its batches have {theirs} prompts each, this config "
                    f"rollout.prompts_per_step={prompts_per_step}; add --set "
                    f"rollout.prompts_per_step={theirs}"
                )
        else:
            groups = sum(len(b) for b in self._batches)
            if groups % prompts_per_step:
                whole = groups // prompts_per_step
                fits = (
                    f"{whole} step{'s' * (whole != 1)} of {prompts_per_step} and {groups % prompts_per_step} left over"
                )
                raise ConfigError(
                    f"--rollouts-from {spec}: {groups} prompt groups do not make whole steps of "
                    f"rollout.prompts_per_step={prompts_per_step} ({fits}); set "
                    "rollout.prompts_per_step to a "
                    f"divisor of {groups}, e.g. --set "
                    f"rollout.prompts_per_step={_divisor(groups, prompts_per_step)}"
                )
        if self.num_steps == 0:  # was "add --set train.steps=0", a value train refuses
            raise ConfigError(f"--rollouts-from {spec}: it holds no rollouts (0 rows)")
        if steps is not None and self.num_steps < steps:
            raise ConfigError(
                f"--rollouts-from {spec}: {self.num_steps} batch{'es' * (self.num_steps != 1)} of "
                f"{prompts_per_step} prompts, fewer than train.steps={steps}; add "
                f"--set train.steps={self.num_steps} "
                "(or store more rollouts)"
            )

    def check_sampled_as(self, cfg, spec: str) -> None:
        """ConfigError unless the batches were sampled as ``cfg`` says (``SAMPLED_AS``; a field the
        file does not record is not compared): one line naming the recorded value, the config's,
        and the ``--set`` that makes them agree."""
        for field, key in SAMPLED_AS:
            if field not in self.meta:
                continue
            recorded, configured = self.meta[field], _get(cfg, key)
            if field == "logprobs_k" and self.vocab_size is not None:  # the lists stored: min(K, vocabulary)
                recorded, configured = _list_size(recorded, self.vocab_size), _list_size(configured, self.vocab_size)
            if _differs(recorded, configured):
                raise ConfigError(
                    f"--rollouts-from {spec} was sampled with {key}={_show(recorded)}, this config "
                    "has "
                    f"{key}={_show(configured)} (pi is computed as mu was "
                    "sampled); "
                    f"add --set {key}={_show(recorded)}"
                )

    def has_routing(self) -> bool:
        """Whether every batch records the engine's routing (``Generation.routing``; model.routing_replay)."""
        if self._files is not None:
            return all(has_routing_column(p) for p in self._files)
        return all(s.gen.routing is not None for groups in self._batches for g in groups for s in g)

    @property
    def num_steps(self) -> int:
        return len(self._files) if self._files is not None else len(self._batches)

    def batch(self, step: int) -> Batch:
        """The step-th batch (1-based), groups renumbered 0..P-1."""
        if self._files is not None:
            self._store.verify(rollout_key(step))  # again: the source may have changed since the start
            samples, meta = self._read(self._files[step - 1])
            return Batch(samples, meta.get("stats") or rollout_stats(_group(samples), len(_group(samples))))
        groups = self._batches[step - 1]
        return Batch(numbered(groups), rollout_stats(groups, len(groups)))

    def _read(self, path: Path):
        return read_rollouts(path, vocab_size=self.vocab_size)

    @staticmethod
    def _check(meta: dict, tokenizer, path: Path) -> None:
        for key, (kind, ok) in RECORDED_KINDS.items():
            if key in meta and not ok(meta[key]):
                raise ArtifactError(f"{path}: its metadata records {key}={meta[key]!r}, not {kind} (docs/ROLLOUTS.md)")
        try:  # a file written before temperatures were checked: T = inf samples uniformly, nothing to train on
            check_sampling(meta.get("temperature", 1.0), meta.get("top_p", 1.0))
        except ConfigError as exc:
            raise ArtifactError(f"{path}: its recorded sampling cannot be trained on ({exc})") from None
        want = meta.get("tokenizer")
        have = tokenizer_fingerprint(tokenizer)
        if want is None:
            raise ArtifactError(f"{path}: rollouts carry no tokenizer fingerprint; cannot check compatibility")
        if want != have:
            raise MasktrlError(
                f"{path}: rollouts were made with another tokenizer ({want}) than this model's "
                f"({have}); "
                "train a model with the same vocabulary"
            )


def _run_batches(root: Path, steps: int | None) -> tuple[RunStore, list[Path]]:
    """The run's store and the rollout files of the run ``root`` for its steps 1, 2, ... (up to ``steps``), each
    verified against the sha256 its manifest records; ArtifactError names the first bad one."""
    if not is_run_folder(root):
        raise MasktrlError(f"--rollouts-from {root}: not a masktrl run folder (no run.yaml) and not a parquet file")
    store = RunStore(root, writable=False)
    recorded = done_steps(store.manifest["stages"], "rollout")
    if not recorded:
        raise MasktrlError(
            f"{root}: no stored rollouts recorded in its manifest (a run with rollout.store=resume "
            "deletes "
            "each batch once a checkpoint covers it)"
        )
    if recorded != list(range(1, len(recorded) + 1)):
        raise ArtifactError(
            f"{root}: stored rollouts cover {len(recorded)} steps between {recorded[0]} and "
            f"{recorded[-1]}, not every step from 1 "
            "(a run with rollout.store=resume keeps only the batches after its newest "
            "checkpoint); "
            "--rollouts-from needs a run that kept them all (rollout.store=all)"
        )
    usable = recorded[: steps or None]
    for step in usable:
        store.verify(rollout_key(step))
    return store, [store.rollout_path(step) for step in usable]


def _get(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _list_size(k, vocab_size: int):
    return min(k, vocab_size) if isinstance(k, int) and not isinstance(k, bool) else k


def _differs(recorded, configured) -> bool:
    if isinstance(configured, float) and isinstance(recorded, (int, float)) and not isinstance(recorded, bool):
        return float(recorded) != configured
    return recorded != configured


def _show(value) -> str:
    return "null" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _group(samples):
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    return list(groups.values())


def _divisor(n: int, near: int) -> int:
    """The divisor of ``n`` closest to ``near`` (ties: the smaller)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), d))
