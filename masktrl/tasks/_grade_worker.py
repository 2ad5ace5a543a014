"""Grading worker process (run by path by :mod:`masktrl.tasks.grader`, never imported).

Protocol, one JSON object per line:
  worker -> parent  {"ready": true}            once math_verify is imported
                    {"error": "..."}           if it cannot start (then exits)
  parent -> worker  {"id": 3, "pred": "...", "gold": "...", "raw": false, "t": 2}
  worker -> parent  {"id": 3, "ok": true}

The worker reads requests until stdin closes. The parent enforces the hard wall-clock
timeout by killing this process; the CPU rlimit set per request is a backstop so an
orphaned worker stuck in a C-level big-integer operation cannot run forever.
Model output only ever reaches math_verify's parser (never eval/exec).
"""

import json
import os
import sys

# Running by path puts this directory first on sys.path; drop it so sibling modules
# (grader.py, base.py, ...) cannot shadow anything math_verify imports.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

_AS_LIMIT = 4 << 30  # bytes of address space; a runaway 10^(10^10) gets MemoryError, not the OOM killer


def _set_limits(cpu_budget_s: int) -> None:
    try:
        import resource

        used = resource.getrusage(resource.RUSAGE_SELF)
        spent = int(used.ru_utime + used.ru_stime) + 1
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = spent + cpu_budget_s
        if hard == resource.RLIM_INFINITY or soft <= hard:
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    except Exception:  # not POSIX, or limits not adjustable: the parent's kill still applies
        pass


def _set_memory_limit() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = _AS_LIMIT if hard == resource.RLIM_INFINITY else min(_AS_LIMIT, hard)
        if soft == resource.RLIM_INFINITY or soft > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except Exception:
        pass


def _wrap(expr: str) -> str:
    """Present an extracted answer to math_verify as inline LaTeX."""
    return expr if "$" in expr else f"${expr}$"


def _grade(parse, verify, pred: str, gold: str, raw: bool, t: int) -> bool:
    gold_parsed = parse(_wrap(gold), parsing_timeout=t)
    pred_parsed = parse(pred if raw else _wrap(pred), parsing_timeout=t)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=t))


def main() -> None:
    out = sys.stdout
    try:
        import logging

        logging.disable(logging.CRITICAL)
        from math_verify import parse, verify
    except Exception as e:  # reported to the parent, which raises a clear error
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return
    _set_memory_limit()
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            t = max(1, int(req["t"]))
        except Exception:
            continue  # not from our parent; nothing sensible to answer
        _set_limits(4 * t + 5)
        try:
            ok = _grade(parse, verify, str(req["pred"]), str(req["gold"]), bool(req["raw"]), t)
        except BaseException as e:  # RecursionError, MemoryError, math_verify's TimeoutException...
            if isinstance(e, KeyboardInterrupt):
                raise
            ok = False
        out.write(json.dumps({"id": req["id"], "ok": ok}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
