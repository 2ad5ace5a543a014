"""The training parts, with no stage logic: collect a batch, update the policy, the policy forward, processes,
checkpoint state, warm start, the sample-and-grade core and the evals (docs/DESIGN.md)."""
