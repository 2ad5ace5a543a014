"""Everything that knows a run folder ``<out>/<run>/`` on disk: the store and its stage keys,
the plan for a folder, locks, retention, listing (docs/DESIGN.md)."""
