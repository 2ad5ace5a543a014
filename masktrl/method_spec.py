"""A run's method as its config names it: a shipped rule or one from a user's file, typed.

``Config.method`` is a ``MethodSpec``: the rule's name, its frozen params dataclass, its
off-policy correction (docs/METHODS.md §14) and, for a rule from a file, the file and its
sha256. ``MethodSpec.bind()`` gives the ``BoundMethod`` whose queries take no params; run.yaml
records the method block as written (``MethodSpec.to_dict``), with the file's sha256.

A rule from a file is named ``path/to/rules.py:name`` (``--method``, ``method.name``, a
``--methods`` entry of a sweep): the file is imported once per content, and the methods it
registers with ``masktrl.methods.register_method`` are kept apart from the shipped ones
(``registry.collecting``), so a file may be edited and loaded again in the same process.
``masktrl.config.resolve_method_spec`` turns any such spec string into a bound method; bad
input is one ``ConfigError`` line.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch

from masktrl.errors import ConfigError, shown
from masktrl.io import importing_user_file, memory_error_line
from masktrl.methods import BoundMethod, CorrectionParams, Method, TokenLosses, get_method, make_correction
from masktrl.methods.batch import NO_GRADIENT
from masktrl.methods.corrections import CustomCorrection, collecting_corrections, install_correction
from masktrl.methods.registry import RESERVED_KEYS, check_method, collecting

RULE_SUFFIX = ".py:"


def is_rule_file(name: Any) -> bool:
    """Whether a method name names a rule in a file (``path/to/rules.py:name``)."""
    return isinstance(name, str) and RULE_SUFFIX in name


def split_rule_file(spec: str) -> tuple[str, str]:
    """``path/to/rules.py:name`` -> ("path/to/rules.py", "name")."""
    path, _, name = spec.rpartition(RULE_SUFFIX)
    return path + ".py", name


@dataclass(frozen=True)
class RuleFile:
    """The file a rule was loaded from: its path as written, and the sha256 of its content now."""

    path: str
    sha256: str
    recorded: str | None = None
    """The sha256 the run's config recorded (run.yaml), when read from one: the file changed
    since if it differs from ``sha256``."""

    @property
    def changed(self) -> bool:
        return self.recorded is not None and self.recorded != self.sha256

    def change(self) -> str:
        """The phrase naming the change, for a file that ``changed``."""
        return (
            f"the rule file {self.path} changed since the run recorded it: sha256 {str(self.recorded)[:12]}... "
            f"now {self.sha256[:12]}..."
        )


@dataclass(frozen=True)
class MethodSpec:
    """The config's ``method`` block, typed: which rule, its params and its correction."""

    rule: str
    """The method as written: a registered name (grpo) or path/to/rules.py:name."""
    name: str
    """The rule's registered name (its file's ``register_method`` name for a rule from a file)."""
    params: Any
    """The rule's frozen params dataclass (``masktrl.methods.params`` for the shipped rules)."""
    correction: CorrectionParams
    """The off-policy correction every rule composes with (``method.correction``, §14)."""
    file: RuleFile | None = None
    """For a rule from a file: the file and its sha256."""
    correction_file: RuleFile | None = None
    """For a correction from a file (``method.correction.kind: path/to/rules.py:name``): the file and its sha256."""
    method: Method | None = field(default=None, compare=False, repr=False)
    block: dict = field(default_factory=dict, compare=False, repr=False)

    def bind(self) -> BoundMethod:
        """The rule bound to its params and its correction."""
        return BoundMethod(self.method, self.params, self.correction)

    def to_dict(self) -> dict:
        """The block as written (what run.yaml records), with a file rule's sha256: the one its
        run recorded when read from a run's config, else the file's now."""
        out = copy.deepcopy(self.block)
        if self.file is not None:
            out["sha256"] = self.file.recorded or self.file.sha256
        if self.correction_file is not None:
            out["correction"]["sha256"] = self.correction_file.recorded or self.correction_file.sha256
        return out

    @property
    def files(self) -> dict[str, RuleFile]:
        """The files this method is read from, by the config key that records their sha256."""
        pairs = (("method.sha256", self.file), ("method.correction.sha256", self.correction_file))
        return {key: f for key, f in pairs if f is not None}

    def resolved(self) -> dict:
        """Every parameter at its value, defaults included; an active correction resolved the
        same way; a file rule's sha256 (two runs of one rule agree on all of it)."""
        out = {"name": self.rule if self.file else self.name, **self.params.__dict__}
        if self.file is not None:
            out["sha256"] = self.file.recorded or self.file.sha256
        if self.correction.active:
            out["correction"] = self.correction.describe()
            if self.correction_file is not None:
                out["correction"]["sha256"] = self.correction_file.recorded or self.correction_file.sha256
        return out


def method_from_block(block: Any) -> MethodSpec:
    """The ``MethodSpec`` of a raw ``method`` block ({name: dppo, divergence: topk-tv, correction: {...}})."""
    if not isinstance(block, dict):
        raise ConfigError(f"method must be a mapping such as {{name: grpo}}, got {block!r}")
    if "name" not in block:
        raise ConfigError("method.name is required")
    rule = block["name"]
    if not isinstance(rule, str):
        raise ConfigError(f"method.name must be a string, got {rule!r}")
    rule_file, recorded = None, block.get("sha256")
    if is_rule_file(rule):
        method, rule_file = load_rule(rule)
        rule_file = RuleFile(rule_file.path, rule_file.sha256, recorded if isinstance(recorded, str) else None)
    else:
        if "sha256" in block:
            raise ConfigError("method.sha256 applies only to a rule from a file (method.name: path/to/rules.py:name)")
        try:
            method = get_method(rule)
        except ValueError as exc:
            raise ConfigError(f"{exc}, or path/to/rules.py:name") from None
    given = {k: v for k, v in block.items() if k not in RESERVED_KEYS}
    corr_block, corr_file = _correction_block(block.get("correction"))
    written = copy.deepcopy(block)
    try:
        if rule_file is not None:
            check_kinds(method.params_cls, given)
        params = method.make_params(**given)
        correction = make_correction(corr_block)
        if (
            correction.ref is None
            and correction.ratio_ref is not None
            and not correction.decoupled
            and isinstance(corr_block, dict)
        ):
            # bypass mode records the ratio's policy explicitly, so a run.yaml without it is one written before
            # corrections took it from pi_old (runs/store.py: legacy_ratio_ref reads those as ref: current)
            correction = make_correction({**corr_block, "ref": correction.ratio_ref})
            written["correction"]["ref"] = correction.ref
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    except (Exception, SystemExit) as exc:  # a user's params class (its __post_init__): anything it raises
        if rule_file is None and corr_file is None:
            raise
        raise ConfigError(f"method {rule!r}: its params {_raised(exc)}") from None
    return MethodSpec(rule, method.name, params, correction, rule_file, corr_file, method, written)


def check_kinds(params_cls: type, values: dict) -> None:
    """ValueError unless each value in ``values`` has the kind of its field's default: a number
    (not a bool, not NaN) for a float field, an integer for an int field, true/false for a bool
    field, text for a str field. Fields defaulting to None or another type are left to the params
    class's own checks. For a rule from a user's file, before its own ``__post_init__``: what its
    params get without a check of their own (``--set method.scale=abc`` or ``=.nan``). The shipped
    params check their values themselves, with their own messages."""
    defaults = {f.name: f.default for f in fields(params_cls)}
    for key, value in values.items():
        kind = type(defaults.get(key))
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        wanted = {
            float: ("a number", number and not (isinstance(value, float) and math.isnan(value))),
            int: ("an integer", number and isinstance(value, int)),
            bool: ("true or false", isinstance(value, bool)),
            str: ("text", isinstance(value, str)),
        }.get(kind)
        if wanted is not None and not wanted[1]:
            raise ValueError(f"method.{key} must be {wanted[0]}, got {value!r}")


def _correction_block(block: Any) -> tuple[Any, RuleFile | None]:
    """The ``method.correction`` block without its recorded sha256, and the file of a correction
    from a file (loaded, and installed as the kind its spec string names)."""
    if not isinstance(block, dict):
        return block, None
    kind, recorded = block.get("kind"), block.get("sha256")
    if not is_rule_file(kind):
        if "sha256" in block:
            raise ConfigError(
                "method.correction.sha256 applies only to a correction from a file (kind: path/to/rules.py:name)"
            )
        return block, None
    rule, found = load_correction(kind)
    install_correction(kind, replace(rule, fn=_guarded_correction(str(kind), rule.fn)))
    rest = {k: v for k, v in block.items() if k != "sha256"}
    return rest, RuleFile(found.path, found.sha256, recorded if isinstance(recorded, str) else None)


# --------------------------------------------------------------------------- rule files

_LOADED: dict[
    tuple[str, str], tuple
] = {}  # (absolute path, sha256) -> (the methods, the corrections) the file registers


def load_rule(spec: str) -> tuple[Method, RuleFile]:
    """The method ``path/to/rules.py:name`` names, and its file; ConfigError (one line) when the
    file is missing or raises on import, the name is not registered in it, or the rule breaks
    the contract (params not a dataclass, a kernel with another signature)."""
    where, name = split_rule_file(spec)
    path, digest = _read(spec, "method")
    found = _import_rules(path, digest, spec)[0]
    if name not in found:
        names = ", ".join(sorted(found)) or "none: it has no @register_method"
        raise ConfigError(f"method {spec!r}: {where} registers no rule {name!r} (it registers: {names})")
    problem = check_method(found[name])
    if problem:
        raise ConfigError(f"method {spec!r}: {problem}")
    return _guarded(spec, found[name]), RuleFile(where, digest)


@cache  # one per rule and spec, as the file is imported once per content
def _guarded(spec: str, method: Method) -> Method:
    """``method`` with its kernel checked at every call: a user's kernel that raises, or returns
    anything but ``TokenLosses`` whose loss is a float tensor [N] and whose mask a bool tensor
    [N], or a loss without a gradient where log pi has one (a ``.detach()``: backward would
    fail), is one ConfigError line naming the rule, not a traceback from inside the update.
    Running out of memory stays what it is (the error boundary names it)."""
    kernel = method.kernel
    hint = f"(masktrl check-method {spec} checks its contract)"

    def checked(batch, adv, params, u):
        out = _call_user(f"method {spec!r}: its kernel", hint, kernel, batch, adv, params, u)
        problem = _losses_problem(out, batch.n)
        if problem is None and torch.is_grad_enabled() and batch.logp.requires_grad and not out.loss.requires_grad:
            problem = NO_GRADIENT
        if problem:
            raise ConfigError(f"method {spec!r}: its kernel returned {problem} {hint}")
        return out

    return replace(method, kernel=checked)


def _guarded_correction(spec: str, fn: Callable) -> Callable:
    """A correction's function from a user's file, checked at every call as ``_guarded`` checks a
    kernel: it must return ``(f, keep)``, each a tensor [N], ``f`` a float one."""
    where = f"method.correction.kind {spec!r}: its function {getattr(fn, '__name__', '?')}"

    def checked(log_rho, valid, seq_ids, adv, keys):
        out = _call_user(where, "", fn, log_rho, valid, seq_ids, adv, keys)
        n = log_rho.shape[0]
        shaped = isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
        if not shaped or any(tuple(t.shape) != (n,) for t in out) or not out[0].is_floating_point():
            got = [f"{t.dtype} [{', '.join(map(str, t.shape))}]" for t in out] if shaped else type(out).__name__
            raise ConfigError(
                f"{where} must return (f, keep), each a tensor of shape [N] = [{n}], f a float one; got {got}"
            )
        return out

    return checked


def _call_user(where: str, hint: str, fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, a user's code: whatever it raises is one ConfigError line naming ``where``
    (running out of memory aside: the error boundary names that)."""
    try:
        return fn(*args)
    except (Exception, SystemExit) as exc:  # sys.exit() in a kernel ended the run with its code and no word
        if memory_error_line(exc) is not None:
            raise
        raise ConfigError(f"{where} {_raised(exc)}" + (f" {hint}" if hint else "")) from exc


def _raised(exc: BaseException) -> str:
    """``raised TypeName: its first line`` for an exception from a user's code."""
    text = (shown(exc).strip().splitlines() or [""])[0]
    return f"raised {type(exc).__name__}" + (f": {text}" if text else "")


def _losses_problem(out: Any, n: int) -> str | None:
    """What is wrong with a kernel's output on a batch of ``n`` tokens, in one phrase, or None:
    loss a float tensor [N], mask a bool one; each optional field None or a tensor [N] (accepted
    bool, the others float), as the update and its diagnostics read them."""
    if not isinstance(out, TokenLosses):
        return f"{type(out).__name__}, not TokenLosses"
    for name in out._fields:
        value, required, boolean = getattr(out, name), name in ("loss", "mask"), name in ("mask", "accepted")
        if value is None and not required:
            continue
        ok = isinstance(value, torch.Tensor) and (value.dtype == torch.bool if boolean else value.is_floating_point())
        if not ok or tuple(value.shape) != (n,):
            if isinstance(value, torch.Tensor):
                what = f"a {value.dtype} tensor of shape {list(value.shape)}"
            else:
                what = "None" if value is None else f"a {type(value).__name__}"
            field_, wanted = (f"a {name}", "") if required else (f"TokenLosses.{name}", "None or ")
            wanted += f"a {'bool' if boolean else 'float'} tensor of shape [N] = [{n}]"
            return f"{field_} that is {what}; it must be {wanted}"
    return None


def load_correction(spec: str) -> tuple[CustomCorrection, RuleFile]:
    """The correction ``path/to/rules.py:name`` names (``masktrl.methods.register_correction``),
    and its file; ConfigError (one line) as ``load_rule``."""
    where, name = split_rule_file(spec)
    path, digest = _read(spec, "method.correction.kind")
    found = _import_rules(path, digest, spec)[1]
    if name not in found:
        names = ", ".join(sorted(found)) or "none: it has no @register_correction"
        raise ConfigError(
            f"method.correction.kind {spec!r}: {where} registers no correction {name!r} (it registers: {names})"
        )
    rule = found[name]
    try:
        inspect.signature(rule.fn).bind(None, None, None, None, None)
    except (TypeError, ValueError):
        raise ConfigError(
            f"method.correction.kind {spec!r}: its function {getattr(rule.fn, '__name__', '?')} must "
            "take "
            "(log_rho, valid, seq_ids, advantages, keys)"
        ) from None
    return rule, RuleFile(where, digest)


def _read(spec: str, key: str) -> tuple[Path, str]:
    """The file a spec names and the sha256 of its content; ConfigError when it cannot be read."""
    where, _ = split_rule_file(spec)
    path = Path(where)
    if path.is_dir():
        raise ConfigError(f"{key} {spec!r}: {where} is a folder; give the Python file that registers the rule")
    if not path.is_file():
        raise ConfigError(f"{key} {spec!r}: no such file {where}")
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key} {spec!r}: cannot read {where} ({exc.strerror or exc})") from None
    return path, hashlib.sha256(content).hexdigest()


def _import_rules(path: Path, digest: str, spec: str) -> tuple[dict[str, Method], dict[str, CustomCorrection]]:
    """The methods and the corrections a rule file registers, importing it once per (path, content)."""
    key = (str(path.resolve()), digest)
    if key in _LOADED:
        return _LOADED[key]
    module_name = f"masktrl_rules_{path.stem}_{digest[:12]}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ConfigError(f"method {spec!r}: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses and typing look their module up by name
    try:
        with importing_user_file(), collecting() as found, collecting_corrections() as corrections:
            loader_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a user's file: whatever it raises is reported in one line
        sys.modules.pop(module_name, None)
        text = shown(exc).strip().splitlines()
        raise ConfigError(
            f"method {spec!r}: {path} raised {type(exc).__name__} on import" + (f": {text[0]}" if text else "")
        ) from None
    _LOADED[key] = (dict(found), dict(corrections))
    return _LOADED[key]


def params_fields(spec: MethodSpec) -> list[str]:
    """The names of the rule's parameters (``method.KEY``)."""
    return [f.name for f in fields(spec.params)]
