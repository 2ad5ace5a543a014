"""Would compiled kernels make the lab's update much faster? ``torch.compile`` (inductor, CPU) on
parts of the policy, against the eager update, by the update's own clock.

docs/BENCHMARKS.md §7 ("Where a lab run's time goes") finds the updates the larger part of a
``fast-packed`` lab run. This runs the lab (configs/lab.yaml with fast-packed's settings:
``rollout.decode=fused``, ``rollout.draw=inverse_cdf``, ``rollout.mismatch=off``; the held-out
evaluations only before and after) for ``--steps`` steps, each variant in a fresh process, and
times every step's ``policy_update``:

- ``eager-packed``: fast-packed as it runs (``train.packing=true``);
- ``eager-padded``: the padded shared-prompt forward (``train.packing=false``, fast's);
- ``norms+mlp``: packed, with each decoder layer's MLP and RMS norms and the final norm compiled
  (dynamic shapes): the fused norms and activations of issue #39.2;
- ``layers``: packed, each decoder layer compiled whole;
- ``model``: padded, the whole decoder (``lm.base_model``) compiled;
- ``model-warm``: ``model`` again, with the compiled code ``model`` left in its cache;
- ``adamw-fused`` (on request): ``eager-packed`` with ``train.adamw=fused``, torch's fused AdamW
  kernel instead of the multi-tensor ones (nothing compiled);
- ``minibatches-2`` and ``minibatches-1`` (on request): ``eager-packed`` with ``train.minibatches``
  2 and 1 instead of the lab's 8, so each forward and backward carries 4 and 8 times the rows
  (nothing compiled; ``train.logprob_chunk`` as many times larger, so that a minibatch's
  log-probabilities stay one chunk whose logits the backward reuses, as the lab's do). Not a
  faster lab: fewer, larger optimizer steps are another algorithm, so another run. They tell how
  much of the update is work per operation (which more rows per operation, from larger minibatches
  or from several runs batched into one process, would share out) and how much is work per row
  (which they would not).

The compilation happens inside the first update (``torch.compile`` compiles on the first call),
each compiled variant but ``model-warm`` starting from an empty inductor cache
(``TORCHINDUCTOR_CACHE_DIR``, a fresh folder). Reported per variant: the first update and the
median of the later ones, the update time of a 300-step lab run projected from them (the first
plus 299 medians), its ratio to ``eager-packed``'s, the response tokens of every update (variants
whose policies part from each other's sample other lengths), and the held-out accuracy after the run:
compiled kernels add in another order, so a compiled run is another run (a different number)
unless it happens to agree. With ``--rounds`` every variant runs that many times, in turn, and
the first and later updates are medians over the rounds (one round is easily disturbed by anything
else the machine runs).

    python benchmarks/compile_update.py --rounds 2 --json benchmarks/results/compile_update.json
    python benchmarks/compile_update.py --variants adamw-fused --rounds 4 \
        --json benchmarks/results/compile_update_adamw.json
    python benchmarks/compile_update.py --variants minibatches-2,minibatches-1 --rounds 2 \
        --json benchmarks/results/compile_update_minibatches.json
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import count, die, finish, median, parser, print_table, quiet, run_masktrl, run_worker, warm_model

LAB = str(Path(__file__).resolve().parents[1] / "configs" / "lab.yaml")
FAST = ["rollout.decode=fused", "rollout.draw=inverse_cdf", "rollout.mismatch=off", "train.eval_every=0"]
LAB_MINIBATCHES = 8  # configs/lab.yaml's train.minibatches
LAB_LOGPROB_CHUNK = 1024  # configs/lab.yaml's train.logprob_chunk (the default): a lab minibatch is one chunk
VARIANTS = {  # name -> (train.packing, what is compiled: None, "norms+mlp", "layers" or "model"; train.adamw;
    #                    train.minibatches)
    "eager-packed": (True, None, "foreach", LAB_MINIBATCHES),
    "eager-padded": (False, None, "foreach", LAB_MINIBATCHES),
    "norms+mlp": (True, "norms+mlp", "foreach", LAB_MINIBATCHES),
    "layers": (True, "layers", "foreach", LAB_MINIBATCHES),
    "model": (False, "model", "foreach", LAB_MINIBATCHES),
    "model-warm": (False, "model", "foreach", LAB_MINIBATCHES),
    "adamw-fused": (True, None, "fused", LAB_MINIBATCHES),
    "minibatches-2": (True, None, "foreach", 2),
    "minibatches-1": (True, None, "foreach", 1),
}
ON_REQUEST = ("adamw-fused", "minibatches-2", "minibatches-1")
DEFAULT_VARIANTS = ",".join(v for v in VARIANTS if v not in ON_REQUEST)
BASELINE = "eager-packed"
RUN_STEPS = 300  # the lab preset's train.steps: the run the projection is for


def compile_parts(base, what: str) -> None:
    """Compile ``what`` of the decoder ``base`` (``lm.base_model``) in place, dynamic shapes (a
    minibatch's token count changes from one update to the next)."""
    if what == "model":
        base.compile(dynamic=True)
        return
    for layer in base.layers:
        if what == "layers":
            layer.compile(dynamic=True)
        else:  # norms+mlp
            for part in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
                part.compile(dynamic=True)
    if what == "norms+mlp":
        base.norm.compile(dynamic=True)


def variant_overrides(variant: str, steps: int, threads: int) -> list[str]:
    """The lab's ``--set`` overrides for ``variant``'s run: fast-packed's rollout settings, its
    forward, its AdamW kernels and minibatches, the steps and the threads."""
    packing, _, adamw, minibatches = VARIANTS[variant]
    return [
        *FAST,
        f"train.packing={str(packing).lower()}",
        f"train.adamw={adamw}",
        f"train.minibatches={minibatches}",
        # a larger minibatch's log-probabilities one chunk too, its logits kept for the backward as the lab's are
        f"train.logprob_chunk={LAB_LOGPROB_CHUNK * LAB_MINIBATCHES // minibatches}",
        f"train.steps={steps}",
        f"train.threads={threads}",
    ]


def worker(variant: str, steps: int, threads: int) -> dict:
    """One variant's run in this process: each update's seconds and the held-out accuracies."""
    import masktrl.recipes.train as recipe
    from masktrl.config import load_config
    from masktrl.rl.policy import base_model

    quiet()
    what = VARIANTS[variant][1]
    cfg = load_config(LAB, variant_overrides(variant, steps, threads))
    warm_model(cfg)  # the warm start is built (or found) before anything is timed
    update = recipe.policy_update
    seconds: list[float] = []
    tokens: list[int] = []  # each update's response tokens: variants whose policies part sample other lengths

    def timed(learner, samples, *a, **k):
        if what is not None and not seconds:  # compiled on the first call, inside the first update
            compile_parts(base_model(learner.model), what)
        t0 = time.perf_counter()
        out = update(learner, samples, *a, **k)
        seconds.append(time.perf_counter() - t0)
        tokens.append(sum(len(s.gen.response_ids) for s in samples))
        return out

    recipe.policy_update = timed
    try:
        run = run_masktrl(cfg)
    finally:
        recipe.policy_update = update
    return {
        "update_s": seconds,
        "update_tokens": tokens,
        "eval_before": run["summary"].get("eval_before"),
        "eval_after": run["summary"].get("eval_after"),
    }


def summarise(name: str, runs: list[dict], base: dict | None) -> dict:
    """A variant's first update and its later ones (each the median over the rounds' runs), the
    updates of a lab run projected from them, and the ratios to ``base`` (eager-packed's row)."""
    first = median([r["update_s"][0] for r in runs])
    later = median([median(r["update_s"][1:]) for r in runs])
    projected = first + (RUN_STEPS - 1) * later
    row = {"variant": name, "runs": runs, "first_update_s": first, "later_update_s": later}
    row.update(run_updates_s=projected, eval_after=[r["eval_after"] for r in runs])
    if base is not None:
        row["ratio_vs_eager_packed"] = base["run_updates_s"] / projected
        row["later_ratio_vs_eager_packed"] = base["later_update_s"] / later
    return row


def run_variant(name: str, cache: Path, args) -> dict:
    """``name``'s run in a fresh process whose inductor cache is ``cache``; a failed run stops the
    benchmark with one line."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    try:
        return run_worker(__file__, name, args, ("steps", "threads"))
    except subprocess.CalledProcessError as exc:
        last = (exc.stderr or "").strip().splitlines()[-1:] or [f"exit code {exc.returncode}"]
        die(f"error: the {name} run failed: {last[0]}")
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def main(argv=None) -> dict:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--steps", type=count, default=30, help="RL steps of each variant's run")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--rounds", type=count, default=1, help="rounds of every variant in turn (medians over them)")
    p.add_argument("--worker", default=None, help="(internal) run one variant in this process")
    args = p.parse_args(argv)
    if args.worker:
        import json

        print(json.dumps(worker(args.worker, args.steps, args.threads)))
        return {}
    if args.steps < 2:
        die("error: --steps must be at least 2 (the first update compiles, the others are timed)")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name in names:
        if name not in VARIANTS:
            die(f"error: unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    if "model-warm" in names and "model" not in names[: names.index("model-warm")]:
        die("error: model-warm reuses the cache model fills: list model before it")
    names = [BASELINE, *(n for n in names if n != BASELINE)]  # the ratios' base runs first
    load_start = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="inductor-") as caches:  # every round compiles afresh
            for name in names:
                runs[name].append(run_variant(name, Path(caches) / ("model" if name == "model-warm" else name), args))
    rows: list[dict] = []
    for name in names:
        rows.append(summarise(name, runs[name], rows[0] if rows else None))
    print_table(
        f"the lab's policy update, eager and compiled ({args.steps} steps, train.threads {args.threads})",
        ["variant", "first update s", "later update s", f"{RUN_STEPS}-step run s", "x eager-packed", "held-out after"],
        [
            [
                r["variant"],
                r["first_update_s"],
                r["later_update_s"],
                r["run_updates_s"],
                r.get("ratio_vs_eager_packed", 1.0),
                ", ".join(f"{x:.3f}" for x in r["eval_after"]),
            ]
            for r in rows
        ],
    )
    argv = argv if argv is not None else sys.argv[1:]
    return finish(
        "compile_update.py",
        argv,
        load_start,
        args.json,
        steps=args.steps,
        rounds=args.rounds,
        threads=args.threads,
        run_steps=RUN_STEPS,
        variants={k: VARIANTS[k] for k in [r["variant"] for r in rows]},
        rows=rows,
    )


if __name__ == "__main__":
    main()
