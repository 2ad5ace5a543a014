"""Training on rollouts produced elsewhere (``masktrl train --rollouts-from RUN_OR_FILE``).

A run folder supplies its stored batches step by step (``steps/<s>/rollouts.parquet``); a
single parquet file (from ``masktrl rollout``) is cut into batches of ``prompts_per_step``
groups, in order. The tokens, behaviour log-probabilities, rewards and advantages are used
exactly as stored, so methods trained from the same source see identical data (reward
shaping and dynamic sampling belong to the run that produced the rollouts).
"""

from __future__ import annotations

from pathlib import Path

from masktrl.errors import ArtifactError, MasktrlError
from masktrl.models.loading import tokenizer_fingerprint
from masktrl.pipeline.collect import rollout_stats
from masktrl.rollout.storage import read_rollouts


class RolloutSource:
    """The batches of a run folder or of one rollout file, checked against this model's tokenizer."""

    def __init__(self, spec: str, prompts_per_step: int, tokenizer):
        path = Path(spec)
        if path.is_dir():
            files = sorted(path.glob("steps/*/rollouts.parquet"))
            if not files:
                raise MasktrlError(f"{path}: no stored rollouts (steps/*/rollouts.parquet; a run with rollout.store=resume "
                                   "deletes each batch once a checkpoint covers it)")
            steps = [int(f.parent.name) for f in files if f.parent.name.isdigit()]
            if steps != list(range(1, len(files) + 1)):
                raise MasktrlError(
                    f"{path}: stored rollouts cover {len(steps)} steps between {steps[0]} and {steps[-1]}, not every step from 1 "
                    "(a run with rollout.store=resume keeps only the batches after its newest checkpoint); "
                    "--rollouts-from needs a run that kept them all (rollout.store=all)"
                )
            self._files = files
            self._batches = None
        elif path.is_file():
            samples, meta = read_rollouts(path)
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
            _, meta = read_rollouts(self._files[0])
            self._check(meta, tokenizer, self._files[0])
            self.meta = {k: v for k, v in meta.items() if k != "stats"}

    @property
    def num_steps(self) -> int:
        return len(self._files) if self._files is not None else len(self._batches)

    def batch(self, step: int):
        """(samples, stats) of the step-th batch (1-based), groups renumbered 0..P-1."""
        if self._files is not None:
            samples, meta = read_rollouts(self._files[step - 1])
            return samples, meta.get("stats") or rollout_stats(_group(samples), len(_group(samples)))
        groups = self._batches[step - 1]
        for g, group in enumerate(groups):
            for s in group:
                s.group = g
        return [s for g in groups for s in g], rollout_stats(groups, len(groups))

    @staticmethod
    def _check(meta: dict, tokenizer, path: Path) -> None:
        want = meta.get("tokenizer")
        have = tokenizer_fingerprint(tokenizer)
        if want is None:
            raise ArtifactError(f"{path}: rollouts carry no tokenizer fingerprint; cannot check compatibility")
        if want != have:
            raise MasktrlError(
                f"{path}: rollouts were made with another tokenizer ({want}) than this model's ({have}); "
                "train a model with the same vocabulary"
            )


def _group(samples):
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    return list(groups.values())
