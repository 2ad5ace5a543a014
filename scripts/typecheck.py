"""Run mypy on the package and the tests and fail on any error not in the committed baseline.

The baseline (``scripts/mypy-baseline.txt``) lists the errors the code had when the type checker
was introduced, one per line as ``path: [code] message`` (no line numbers, so moving code does
not churn it). A new error fails; an error that is gone is reported so the baseline can shrink:

    python scripts/typecheck.py            # check (CI)
    python scripts/typecheck.py --update   # rewrite the baseline after fixing errors
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "scripts" / "mypy-baseline.txt"
TARGETS = ["masktrl", "tests"]
LINE = re.compile(r"^(?P<path>[^:]+):\d+(?::\d+)?: error: (?P<msg>.*?)\s+\[(?P<code>[a-z-]+)\]$")


def current_errors() -> collections.Counter[str]:
    out = subprocess.run(
        [sys.executable, "-m", "mypy", *TARGETS, "--no-error-summary", "--no-pretty", "--show-error-codes"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode not in (0, 1):  # 2: mypy itself failed (bad config, crash)
        sys.exit(f"mypy failed (exit {out.returncode}):\n{out.stderr or out.stdout}")
    errors: collections.Counter[str] = collections.Counter()
    for line in out.stdout.splitlines():
        m = LINE.match(line.strip())
        if m:
            errors[f"{m['path']}: [{m['code']}] {m['msg']}"] += 1
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline from today's errors")
    args = parser.parse_args()
    errors = current_errors()
    if args.update:
        BASELINE.write_text("".join(f"{e}\n" for e in sorted(errors.elements())))
        print(f"baseline: {sum(errors.values())} errors written to {BASELINE.relative_to(ROOT)}")
        return 0
    known = collections.Counter(BASELINE.read_text().splitlines()) if BASELINE.exists() else collections.Counter()
    new = errors - known
    gone = known - errors
    for e in sorted(new.elements()):
        print(f"new type error: {e}")
    if gone:
        print(f"{sum(gone.values())} baseline errors are fixed: run `python scripts/typecheck.py --update`")
    print(f"mypy: {sum(errors.values())} errors, {sum(known.values())} in the baseline, {sum(new.values())} new")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
