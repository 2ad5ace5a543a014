"""Rollouts with transformers ``generate`` (batched, KV cache): the CPU engine.

Recorded log-probabilities are ``log_softmax`` of the *processed* scores that ``generate``
samples from, i.e. ``log_softmax(logits / T)`` with ``top_p = 1``. With ``top_p < 1`` the
scores of tokens outside the nucleus are ``-inf``: the recorded distribution is then the
truncated, renormalised one actually sampled from, and such tokens appear in the top-K
lists (if K exceeds the nucleus) as zero-mass atoms (``-inf``), as SPEC §0 allows.
"""

from __future__ import annotations

import torch

from masktrl.rollout.base import Generation, SamplingSettings


def sampling_kwargs(s: SamplingSettings) -> dict:
    if s.greedy:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    # generation_config defaults to top_k=50: switch it off so we sample the full softmax(z/T)
    return {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p, "top_k": 0}


class HFEngine:
    """Generation with the training model itself (no copy: weights are always in sync)."""

    name = "hf"

    def __init__(self, model: torch.nn.Module, tokenizer, *, batch_size: int = 512):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size  # prompts x n generated together

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], settings: SamplingSettings, seed: int) -> list[list[Generation]]:
        per_call = max(1, self.batch_size // settings.n)
        gens: list[list[Generation]] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), per_call):
                gens.extend(self._generate_chunk(prompts[start : start + per_call], settings))
        return gens

    def _generate_chunk(self, prompts: list[list[int]], s: SamplingSettings) -> list[list[Generation]]:
        tok = self.tokenizer
        width = max(len(p) for p in prompts)
        pad = tok.pad_token_id
        device = next(self.model.parameters()).device  # a GPU under accelerate launch
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [P, W] left-padded
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        was_training = self.model.training
        self.model.eval()
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            **sampling_kwargs(s),
            max_new_tokens=s.max_new_tokens,
            num_return_sequences=s.n,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
        )
        self.model.train(was_training)
        new = out.sequences[:, width:]  # [P*n, T]
        k = s.logprobs_k
        logp_steps, ids_steps, topk_steps = [], [], []
        for t, scores in enumerate(out.scores):  # one [P*n, V] tensor per generated position
            lp = torch.log_softmax(scores.float(), dim=-1)
            top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
            logp_steps.append(lp.gather(1, new[:, t : t + 1]).squeeze(1))
            ids_steps.append(top_ids)
            topk_steps.append(top_lp)
        logp = torch.stack(logp_steps, 1).tolist()  # [P*n, T]
        top_ids = torch.stack(ids_steps, 1).tolist()  # [P*n, T, K]
        top_lp = torch.stack(topk_steps, 1).tolist()
        rows = new.tolist()
        result: list[list[Generation]] = []
        for i in range(len(prompts)):
            group = []
            for j in range(i * s.n, (i + 1) * s.n):
                ids = rows[j]
                length = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else len(ids)
                group.append(
                    Generation(
                        response_ids=ids[:length],
                        logp=logp[j][:length],
                        topk_ids=top_ids[j][:length],
                        topk_logp=top_lp[j][:length],
                        finished=length < len(ids) or ids[length - 1] == tok.eos_token_id,
                    )
                )
            result.append(group)
        return result
