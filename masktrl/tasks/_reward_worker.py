"""Reward worker process (run by path by :mod:`masktrl.tasks.rewards`, never imported).

Started as ``python -u _reward_worker.py INIT`` where INIT is JSON:
``{"location": {"module": "pkg.mod" | "file": "/abs/x.py", "attr": "fn"}, "path": [sys.path of the parent]}``.

Protocol, one JSON object per line:
  worker -> parent  {"ready": true}                  once the function is imported
                    {"error": "..."}                 if it cannot be (then exits)
  parent -> worker  {"kwargs": {"prompts": [...], "completions": [...], "answers": [...], field: [...]}, "n": 1}
  worker -> parent  {"scores": [0.5, ...]}           what the function returned (floats, NaN, or null)
                    {"raised": "ValueError: ..."}    it raised
                    {"bad": "..."}                   it cannot take the arguments, or returned a wrong
                                                     number of values or something not a number

The parent enforces the hard wall-clock timeout by killing this process.
"""

import importlib
import importlib.util
import inspect
import json
import numbers
import os
import sys


def _load(location: dict):
    attr = location["attr"]
    if "file" in location:
        path = location["file"]
        name = "masktrl_reward_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
        sys.path.insert(0, os.path.dirname(path))  # the file's own imports of its neighbours
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        where = path
    else:
        module = importlib.import_module(location["module"])
        where = location["module"]
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{where} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{where}:{attr} is not callable")
    return obj


def _values(out, n: int):
    """The returned scores as a list of floats/None, or an error message."""
    if hasattr(out, "tolist"):  # numpy / torch
        out = out.tolist()
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        return f"returned a {type(out).__name__}, expected a list of {n} numbers (one per completion)"
    out = list(out)
    if len(out) != n:
        return f"returned {len(out)} values for {n} completions (expected one number per completion)"
    values = []
    for v in out:
        if v is None or isinstance(v, bool):
            values.append(None if v is None else float(v))
        elif isinstance(v, numbers.Real):
            values.append(float(v))
        else:
            return f"returned a {type(v).__name__} value {str(v)[:50]!r}, expected numbers"
    return values


def main() -> None:
    # The protocol gets its own copy of stdout; whatever the reward prints goes to stderr (discarded).
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    init = json.loads(sys.argv[1])
    sys.path[:] = init["path"]
    from masktrl.errors import shown  # the parent's path: its masktrl (an error's str() may raise)

    try:
        fn = _load(init["location"])
        params = inspect.signature(fn).parameters
    except BaseException as e:  # SyntaxError, ImportError, SystemExit from a script...
        loc = init["location"]
        what = loc.get("file") or loc.get("module")
        out.write(
            json.dumps(
                {
                    "error": f"cannot import {loc['attr']!r} from {what} ({type(e).__name__}: {shown(e)})".replace(
                        "\n", " "
                    )
                }
            )
            + "\n"
        )
        out.flush()
        return
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            kwargs, n = req["kwargs"], int(req["n"])
        except Exception:
            continue  # not from our parent
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        try:
            inspect.signature(fn).bind(**kwargs)
        except TypeError as e:
            reply = {"bad": f"cannot be called with prompts, completions, answers and the example's fields ({e})"}
        else:
            try:
                result = _values(fn(**kwargs), n)
                reply = {"bad": result} if isinstance(result, str) else {"scores": result}
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt):
                    raise
                reply = {"raised": f"{type(e).__name__}: {shown(e)}"[:500]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
