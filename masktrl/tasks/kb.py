"""The agentic lab's task (docs/TASKS.md, "The agentic lab"; configs/agentic.yaml): questions about
a small synthetic knowledge base that only the search tool can see.

Every problem has its own world, drawn from the problem's seed: ``world_persons`` people, each
with a city and a firm, and ``world_firms`` firms, each with a city, named from fixed pools
(``p0..``, ``f0..``, ``c0..``). The world is the problem's ``documents`` field, one document per
entity (``"p3 city c4 firm f2"``, ``"f2 city c7"``), and never part of the prompt: a policy
learns to search, not the facts (a new world per problem: nothing to memorise), so one that does
not search answers at chance (about 1 / ``cities``).

Questions (the prompt), one or two searches each:

* ``city p3 ?``: the city of p3 (one search: ``p3``)
* ``firm p3 ?``: the firm of p3 (one search)
* ``city firm p3 ?``: the city of p3's firm (two searches: ``p3``, then the firm; multi-hop)

A response calls the search tool (``KBSearch``: BM25 over the problem's documents, the best
match only) with ``<search> QUERY </search>`` and ends with ``answer VALUE``; reward 1 iff the
first word after the response's last ``answer`` is the answer. A firm's document is shorter than
every person's that names the firm, so BM25 ranks it first for the firm's name.

The warm start (``rl/warmstart.py``) trains on demonstrations (``demonstration``): the calls,
the tool's replies (not trained on: environment tokens) and the answer. The model's tokenizer is
``model.tokenizer: words``: one token per word of ``alphabet()`` (a few hundred tokens).
``direct_prompt`` gives the prompt of a policy forbidden to call the tool (the answer marker
appended, so its first token is the answer): ``eval_after_no_tool`` in a run's summary.
"""

from __future__ import annotations

import hashlib
import random

from masktrl.errors import ConfigError
from masktrl.tasks.base import Example, register_task
from masktrl.tasks.synthetic import SyntheticTask, int_option
from masktrl.tasks.tools import Search

CALL, CALL_END, ANSWER = "<search>", "</search>", "answer"
QUESTIONS = ("city", "firm", "city firm")  # the attribute path read from the person
KEYWORDS = ("city", "firm", "?", CALL, CALL_END, ANSWER, "no", "results")


class KBSearch(Search):
    """The shipped BM25 ``Search`` over the problem's documents, replying with the best match only."""

    top_n = 1


def final_answer(completion: str) -> str | None:
    """The first word after the last ``answer`` of ``completion``, or None."""
    words = completion.split() if isinstance(completion, str) else []
    if ANSWER not in words:
        return None
    at = len(words) - 1 - words[::-1].index(ANSWER)
    return words[at + 1] if at + 1 < len(words) else None


@register_task("kb")
class KBTask(SyntheticTask):
    """Questions about a per-problem knowledge base that need one or two searches.

    Args:
        persons, firms, cities: the sizes of the name pools. Defaults 40, 20, 40.
        world_persons, world_firms: the entities of one problem's world. Defaults 6 and 3.
        two_hop: the fraction of two-search questions. Default 0.5.
        n_test: size of the held-out split. Default 500.
        seed: seed of the held-out split (training problems come from the caller's rng).
    """

    name = "kb"
    extract_answer = staticmethod(final_answer)  # eval's maj@k votes on it

    def __init__(
        self,
        persons: int = 40,
        firms: int = 20,
        cities: int = 40,
        world_persons: int = 6,
        world_firms: int = 3,
        two_hop: float = 0.5,
        n_test: int = 500,
        seed: int = 1234,
    ) -> None:
        self.persons = int_option("kb", "persons", persons, 2, 1000)
        self.firms = int_option("kb", "firms", firms, 2, 1000)
        self.cities = int_option("kb", "cities", cities, 2, 1000)
        self.world_persons = int_option("kb", "world_persons", world_persons, 1, self.persons)
        self.world_firms = int_option("kb", "world_firms", world_firms, 1, self.firms)
        if isinstance(two_hop, bool) or not isinstance(two_hop, (int, float)) or not 0 <= two_hop <= 1:
            raise ConfigError(f"kb: two_hop must be a number in [0, 1], got {two_hop!r}")
        self.two_hop = float(two_hop)
        self.n_test = int_option("kb", "n_test", n_test, 1, 100_000)
        self.seed = int_option("kb", "seed", seed, -(2**63), 2**63 - 1)
        self._draw_split(self.n_test)

    # ----------------------------------------------------------------- Task protocol (and SyntheticTask's)
    def score(self, example: Example, completion: str) -> float:
        return float(final_answer(completion) == example.answer)

    def score_many(self, examples: list[Example], completions: list[str]) -> list[float]:
        return [self.score(e, c) for e, c in zip(examples, completions, strict=True)]

    def format_target(self, example: Example) -> str:
        return " ".join(text for text, _ in self.demonstration(example))

    def alphabet(self) -> str:
        """The words of every prompt, call, reply and answer (``model.tokenizer: words``)."""
        names = [f"p{i}" for i in range(self.persons)] + [f"f{i}" for i in range(self.firms)]
        return " ".join([*KEYWORDS, *names, *(f"c{i}" for i in range(self.cities))])

    def demonstration(self, example: Example) -> list[tuple[str, bool]]:
        """A demonstration episode as (text, trained) segments: the calls and the answer (trained),
        the tool's replies (not: environment tokens)."""
        docs = {d.split()[0]: d for d in example.meta["fields"]["documents"]}
        *path, person = example.prompt.split()[:-1]
        out, entity = [], person
        for hop in range(len(path)):
            out += [(f"{CALL} {entity} {CALL_END}", True), (docs[entity], False)]
            if hop + 1 < len(path):
                words = docs[entity].split()
                entity = words[words.index("firm") + 1]
        return [*out, (f"{ANSWER} {example.answer}", True)]

    def direct_prompt(self, example: Example) -> Example:
        """``example`` for a policy forbidden to call the tool: the answer marker appended to the prompt."""
        return Example(example.id, f"{example.prompt} {ANSWER}", example.answer, example.meta)

    # ----------------------------------------------------------------- helpers
    def _draw(self, rng: random.Random) -> tuple:
        people = rng.sample(range(self.persons), self.world_persons)
        firms = rng.sample(range(self.firms), self.world_firms)
        person_facts = tuple((p, rng.randrange(self.cities), rng.choice(firms)) for p in people)
        firm_facts = tuple((f, rng.randrange(self.cities)) for f in firms)
        hops = 2 if rng.random() < self.two_hop else 1
        question = QUESTIONS[2] if hops == 2 else rng.choice(QUESTIONS[:2])
        return question, rng.randrange(self.world_persons), person_facts, firm_facts

    def _example_of(self, split: str, key: tuple, rng: random.Random) -> Example:
        question, who, person_facts, firm_facts = key
        p, city, firm = person_facts[who]
        firm_city = dict(firm_facts)
        answer = {"city": f"c{city}", "firm": f"f{firm}", "city firm": f"c{firm_city[firm]}"}[question]
        docs = [f"p{q} city c{c} firm f{f}" for q, c, f in person_facts] + [f"f{f} city c{c}" for f, c in firm_facts]
        return Example(
            id=f"{split}/{hashlib.sha256(repr(key).encode()).hexdigest()[:12]}",
            prompt=f"{question} p{p} ?",
            answer=answer,
            meta={"fields": {"documents": docs}},
        )
