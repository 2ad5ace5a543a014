"""Multi-turn, tool-using rollouts with the transformers engine (docs/ROLLOUTS.md, "Multi-turn
rollouts").

A turn is one call of the engine on each running episode's token prefix (the prompt and its
response so far, as token ids): the policy samples until EOS, the task's stop string (the end of
a tool call) or the turn's token limit. A turn that ends with the stop string is passed to the
environment (``tasks.envs.Episode``: reset with the example's row, step with the turn's text),
whose reply is tokenised on its own and appended as tokens: the transcript itself is never
re-tokenised (token-in, token-out), so the policy trains on exactly the ids it sampled after.
The episode goes on until EOS, the environment ends it, ``max_turns`` policy turns, or
``max_tokens`` response tokens in all (a reply is cut to what is left).

Policy tokens carry what the engine recorded (log mu, top-K lists); environment tokens carry
none (log mu -inf, an all-padding top-K list) and ``Generation.source`` / ``turn`` say which is
which. Tokens the engine sampled past a turn's stop string are discarded: the kept prefix's
records are exactly those of the tokens sampled, whatever came after them.

Both engines run it. The turn's ``SamplingSettings.stop`` holds the stop string: vLLM stops the
request there (its detokenizer watches the text; the ids up to the token that completes the
string are returned), the hf engine samples the turn's budget; ``stop_cut`` then finds the same
cut in either's ids. Every later turn is a new request whose prompt is the episode's token ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from masktrl.rollout.base import ENVIRONMENT, POLICY, Generation, SamplingSettings

TURN_SEED_STRIDE = 1_000_003  # turn t of a batch samples with seed + t * stride (distinct, reproducible streams)


REPLY_CHARS_PER_TOKEN = 64
"""A reply longer than this many characters per token of budget left is cut to that length before
it is tokenised (a tool that prints megabytes made each episode's tokenisation take seconds)."""


def reply_tokens(tokenizer, reply: str, left: int) -> tuple[list[int], bool]:
    """The environment's reply as at most ``left`` token ids, and whether it was cut to fit. The
    text is first cut to ``REPLY_CHARS_PER_TOKEN * (left + 1)`` characters: the ids kept are the
    full text's unless the tokenizer joins more than that many characters around the cut into
    one piece (a single run of about 64 characters per budget token with no break)."""
    if not reply:
        return [], False
    limit = REPLY_CHARS_PER_TOKEN * (left + 1)
    ids = tokenizer.encode(reply[:limit], add_special_tokens=False)
    return ids[:left], len(ids) > left or len(reply) > limit


def stop_cut(ids: list[int], decode: Callable[[list[int]], str], stop: str) -> int | None:
    """The length of the shortest prefix of ``ids`` whose text contains ``stop``, or None."""
    if not stop or stop not in decode(ids):
        return None
    lo, hi = 1, len(ids)  # containment is monotone in the prefix length
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


class _Episode:
    """One response being built: its records and where it stands."""

    def __init__(self, prompt: list[int], env):
        self.prompt, self.env = prompt, env
        self.ids: list[int] = []
        self.logp: list[float] = []
        self.topk_ids: list[list[int]] = []
        self.topk_logp: list[list[float]] = []
        self.source: list[int] = []
        self.turn: list[int] = []
        self.finished = False
        self.running = True

    def add(self, gen: Generation, n: int, turn: int) -> None:
        self.ids += gen.response_ids[:n]
        self.logp += gen.logp[:n]
        self.topk_ids += gen.topk_ids[:n]
        self.topk_logp += gen.topk_logp[:n]
        self.source += [POLICY] * n
        self.turn += [turn] * n

    def add_reply(self, ids: list[int], turn: int) -> None:
        k = len(self.topk_ids[-1])  # the engine's list width, min(K, vocabulary); a reply always follows a policy token
        self.ids += ids
        self.logp += [float("-inf")] * len(ids)
        self.topk_ids += [[-1] * k for _ in ids]
        self.topk_logp += [[float("-inf")] * k for _ in ids]
        self.source += [ENVIRONMENT] * len(ids)
        self.turn += [turn] * len(ids)

    def generation(self) -> Generation:
        return Generation(
            self.ids, self.logp, self.topk_ids, self.topk_logp, self.finished, source=self.source, turn=self.turn
        )


def generate_multi_turn(
    engine,
    tokenizer,
    prompts: list[list[int]],
    examples: list[dict],
    settings: SamplingSettings,
    seed: int,
    new_episode: Callable[[], object],
    *,
    stop: str,
    max_turns: int,
    max_tokens: int,
) -> list[list[Generation]]:
    """``settings.n`` multi-turn responses per prompt (in prompt order), each an episode of its
    own environment: ``new_episode()`` gives an object with ``reset(example) -> bool`` and
    ``step(text) -> (reply, done)`` (``tasks.envs.Episode``: failures already isolated and
    counted). ``examples[i]`` is prompt i's row. ``settings.max_new_tokens`` bounds each policy
    turn, ``max_tokens`` the whole response, ``max_turns`` the policy turns."""
    if settings.truncated:
        raise ValueError("multi-turn rollouts record no kept sets: sample with top_p = 1 and top_k = 0")
    n = settings.n
    eos = tokenizer.eos_token_id

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    episodes: list[_Episode] = []
    for prompt, example in zip(prompts, examples):
        for _ in range(n):
            env = new_episode()
            ep = _Episode(list(prompt), env)
            if not env.reset(example):
                ep.env = None  # the environment failed to start: the episode is a single turn (still sampled)
            episodes.append(ep)
    for turn in range(max_turns):
        live = [ep for ep in episodes if ep.running and len(ep.ids) < max_tokens]
        if not live:
            break
        budget = min(settings.max_new_tokens, min(max_tokens - len(ep.ids) for ep in live))
        turn_settings = replace(settings, max_new_tokens=budget, stop=(stop,) if stop else ())
        if turn == 0:  # one prefill per prompt, n samples each (the engine's shared prefill)
            gens = [g for group in engine.generate(prompts, turn_settings, seed) for g in group]
        else:  # a new request per episode: its token prefix (prompt, policy and environment ids) as is
            out = engine.generate(
                [ep.prompt + ep.ids for ep in live], replace(turn_settings, n=1), seed + turn * TURN_SEED_STRIDE
            )
            gens = [group[0] for group in out]
        for ep, gen in zip(live, gens):
            ids = gen.response_ids
            cut = stop_cut(ids, decode, stop) if ep.env is not None else None
            if cut is not None and (eos not in ids or cut <= ids.index(eos)):
                ep.add(gen, cut, turn)
                reply, done = ep.env.step(decode(ep.ids[len(ep.ids) - cut :]))
                left = max_tokens - len(ep.ids)
                reply_ids, cut_reply = reply_tokens(tokenizer, reply, left)
                if cut_reply and hasattr(ep.env, "cut"):
                    ep.env.cut()  # counted (env_truncated): the reply is cut to the budget left
                ep.add_reply(reply_ids, turn)
                if done:
                    ep.running, ep.finished = False, True
                elif turn + 1 == max_turns or len(ep.ids) >= max_tokens:
                    ep.running = False  # out of turns or tokens: cut, not finished
            else:
                ep.add(gen, len(ids), turn)
                ep.running, ep.finished = False, gen.finished
    return [[ep.generation() for ep in episodes[i * n : (i + 1) * n]] for i in range(len(prompts))]
