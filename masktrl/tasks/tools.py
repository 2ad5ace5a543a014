"""The shipped tools: environments (``masktrl.tasks.envs`` protocol) for ``task.env``
(docs/TASKS.md, "Environments").

* ``Calculator``: ``<calc>EXPR</calc>`` -> the value of an arithmetic expression, evaluated on
  its ``ast`` (numbers, + - * / // % **, unary signs, parentheses; nothing else: no names, no
  calls, no ``eval``), exponents and results bounded so no call can run away.
* ``Search``: ``<search>QUERY</search>`` -> the best-matching documents of a local corpus, ranked
  by BM25 (``bm25s``, the ``agentic`` extra). The corpus is the example's ``documents`` field
  (a list of texts), or a subclass's ``corpus`` attribute (the same for every example).

A call's text is what the model wrote in its turn; the tools read the last ``<calc>``/
``<search>`` element in it (a call without the closing tag, cut by the stop string, is read up
to the end). Neither tool ends the episode: the model answers when it is ready.
"""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30
MAX_CALL_CHARS = 2000


def call_content(call: str, tag: str) -> str:
    """The text of the last ``<tag>...</tag>`` element of ``call`` (the closing tag optional);
    the whole call, stripped, without one."""
    start = call.rfind(f"<{tag}>")
    if start < 0:
        return call.strip()
    body = call[start + len(tag) + 2 :]
    end = body.find(f"</{tag}>")
    return (body if end < 0 else body[:end]).strip()


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression the calculator does not evaluate."""


def calculate(expr: str) -> int | float:
    """The value of the arithmetic ``expr``; CalcError for anything else (names, calls,
    attributes, strings, a too large exponent or result, division by zero)."""
    if len(expr) > MAX_CALL_CHARS:
        raise CalcError("expression too long")
    try:
        tree = ast.parse(expr.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise CalcError("not an arithmetic expression") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (
            abs(b) > MAX_EXPONENT or (abs(a) > 1 and abs(b) * math.log10(abs(a) + 1) > 30)
        ):
            raise CalcError("exponent too large")
        try:
            value = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except (OverflowError, ValueError) as exc:
            raise CalcError(str(exc)) from None
        if (
            isinstance(value, complex)
            or abs(value) > MAX_MAGNITUDE
            or (isinstance(value, float) and not math.isfinite(value))
        ):
            raise CalcError("result out of range")
        return value
    raise CalcError(f"unsupported element {type(node).__name__}")


def format_number(value: int | float) -> str:
    """An integral value without a decimal point; others with up to 12 significant digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class Calculator:
    """``<calc>EXPR</calc>`` -> ``EXPR``'s value, or ``error: ...``."""

    tag = "calc"
    stop = "</calc>"  # the call's end: task.call_stop's default

    def reset(self, example: dict) -> None:
        pass

    def step(self, call: str) -> tuple[str, bool]:
        try:
            return format_number(calculate(call_content(call, self.tag))), False
        except CalcError as exc:
            return f"error: {exc}", False


class Search:
    """``<search>QUERY</search>`` -> the ``top_n`` best BM25 matches of the corpus, one per line
    (``no results`` when nothing matches). The corpus: the example's ``documents`` field, else the
    class's ``corpus``. Indexes are cached per distinct corpus (``cache_size`` of them)."""

    tag = "search"
    stop = "</search>"  # the call's end: task.call_stop's default
    top_n = 2
    corpus: tuple[str, ...] = ()
    cache_size = 64
    _cache: dict = {}

    def reset(self, example: dict) -> None:
        docs = example.get("documents")
        self.docs = tuple(str(d) for d in docs) if isinstance(docs, (list, tuple)) else tuple(self.corpus)
        self.index = self._index(self.docs) if self.docs else None

    @classmethod
    def _index(cls, docs: tuple[str, ...]):
        key = (cls.__qualname__, docs)
        if key not in cls._cache:
            import bm25s  # the agentic extra

            if len(cls._cache) >= cls.cache_size:
                cls._cache.pop(next(iter(cls._cache)))
            retriever = bm25s.BM25()
            retriever.index(bm25s.tokenize(list(docs), stopwords=None, show_progress=False), show_progress=False)
            cls._cache[key] = retriever
        return cls._cache[key]

    def search(self, query: str) -> list[str]:
        """The best matches of ``query`` (positive BM25 score only), best first."""
        if self.index is None or not re.search(r"\w", query):
            return []
        import bm25s

        tokens = bm25s.tokenize([query[:MAX_CALL_CHARS]], stopwords=None, show_progress=False)
        k = min(self.top_n, len(self.docs))
        ids, scores = self.index.retrieve(tokens, k=k, show_progress=False)
        return [self.docs[int(i)] for i, s in zip(ids[0], scores[0]) if s > 0]

    def step(self, call: str) -> tuple[str, bool]:
        hits = self.search(call_content(call, self.tag))
        return ("\n".join(hits) if hits else "no results"), False
