"""What machine and code a run ran on, for its summary.json (docs/RESULTS.md, "The data behind the
tables"): the CPU model, the torch thread count, and the git commit when masktrl runs from a git
checkout. No network; a value that cannot be read is left out rather than guessed."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds masktrl/ (a checkout's root)


def cpu_model() -> str | None:
    """The CPU's model name: /proc/cpuinfo's first ``model name`` (Linux), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def git_commit(root: Path = PACKAGE_ROOT) -> str | None:
    """``git rev-parse HEAD`` of the checkout masktrl is imported from (plus ``-dirty`` when tracked
    files differ from it); None when masktrl is not in a git checkout or git is missing."""
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def machine(threads: int) -> dict:
    """summary.json's ``machine``: {cpu_model, threads (train.threads), torch_threads (what torch
    uses), platform, torch, commit}; keys whose value is unknown are absent."""
    out = {
        "cpu_model": cpu_model(),
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "commit": git_commit(),
    }
    return {k: v for k, v in out.items() if v is not None}
