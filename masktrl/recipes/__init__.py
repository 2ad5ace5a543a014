"""The stages, one per command, each a ``run()`` callable without typer: train,
preflight (--dry-run), eval, rollout, sweep (docs/DESIGN.md)."""
