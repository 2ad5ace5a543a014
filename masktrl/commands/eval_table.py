"""The rows of ``masktrl eval``'s report table that only some reports have."""

from __future__ import annotations


def tool_rows(tools: dict | None) -> list[tuple[str, str]]:
    """A multi-turn report's tool statistics (``report["tools"]``) as table rows."""
    if not tools:
        return []

    def share(v):
        return "-" if v is None else f"{v:.4f}"

    return [
        ("tool calls per episode", f"{tools['calls_per_episode']:.2f}"),
        ("episodes that called the tool", f"{tools['searched_frac']:.1%}"),
        ("accuracy given a call", share(tools["accuracy_given_search"])),
        ("accuracy without a call", share(tools["accuracy_without_search"])),
    ]
