"""masktrl's rules inside TRL: ``MasktrlGRPOTrainer``, a ``trl.GRPOTrainer`` whose loss is a masktrl rule.

    from masktrl.integrations.trl import MasktrlGRPOTrainer
    trainer = MasktrlGRPOTrainer(method="pdm", model=model, processing_class=tokenizer,
                                 reward_funcs=reward, args=GRPOConfig(...), train_dataset=dataset)
    trainer.train()

``method`` is any spec string ``masktrl sweep --methods`` takes (a shipped rule with its
``key=value`` params, or ``path/to/rules.py:name``); ``correction`` a ``method.correction`` block
(docs/METHODS.md §14). TRL keeps everything else: its sampler, generation, rewards, advantages
(``GRPOConfig.scale_rewards`` ...), optimizer and logging. What changes:

* generation (transformers ``generate``, TRL's default backend) records, for every generated
  token, the behaviour's log-probability of it and its top-``logprobs_k`` list (``TopKRecorder``);
* the loss is the rule's, computed by ``masktrl.integrations.tokens.rule_loss`` exactly as
  masktrl's own update does, from one forward of the policy that keeps the full distribution (the
  log-probabilities at the sampled and the listed ids, ``sum pi^2`` for pdm ``tail=exact``, the
  entropy), divided by TRL's gradient-accumulation steps as TRL's ``grpo`` loss is.

How the lists are recorded, and why this way: transformers merges a caller's logits processors
*before* its sampling warpers (``generation/utils.py``, ``_get_logits_processor``: the custom list
is merged, then temperature, top-k, top-p, min-p are appended), so a processor alone sees the
logits before temperature, not the distribution sampled from. ``output_scores`` holds that
distribution but needs ``return_dict_in_generate``, which changes what ``generate`` returns to TRL,
and keeps a [B, V] tensor per step. ``TopKRecorder`` is a processor that applies the generation
config's own warpers (transformers' classes, same order, same parameters) to a copy of the scores
it is handed and keeps only the top-K of the resulting log-softmax and the sampled token's entry:
the exact sampling distribution (tests/test_integrations_trl.py compares it with
``output_scores``), O(B·K) per step. It enters TRL's ``generate`` call as its ``logits_processor``
argument for the duration of ``_generate_single_turn``.

Not supported (one ``ConfigError`` line): vLLM or continuous-batching generation (use
``masktrl.integrations.verl``'s contract for vLLM's ``logprobs=K``), tool calling, a rule with an
in-loss reference KL (``kl_coef > 0``: use TRL's ``beta``), warpers other than temperature,
top-k, top-p, min-p.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from trl import GRPOTrainer

from masktrl.errors import ConfigError
from masktrl.integrations.tokens import (
    bind,
    keyed_uniforms,
    needs_topk,
    padded_token_batch,
    rule_loss,
    token_advantages,
)

__all__ = ["MasktrlGRPOTrainer", "TopKRecorder", "sampling_warpers"]

BEHAVIOUR_KEYS = ("behavior_logp", "behavior_topk_ids", "behavior_topk_logp")
OLD_KEYS = ("old_logp", "old_topk_logp")


def sampling_warpers(gc) -> LogitsProcessorList:
    """The warpers transformers appends for sampling with generation config ``gc``, in its order
    (``generation/utils.py: _get_logits_processor``); ConfigError for one this module does not rebuild."""
    for name in ("top_h", "watermarking_config"):
        if getattr(gc, name, None) is not None:
            raise ConfigError(
                f"MasktrlGRPOTrainer: generation_config.{name} is not supported (the recorded "
                "top-K lists would miss it)"
            )
    for name in ("typical_p", "epsilon_cutoff", "eta_cutoff"):
        value = getattr(gc, name, None)
        if value is not None and 0.0 < value < 1.0:
            raise ConfigError(
                f"MasktrlGRPOTrainer: generation_config.{name} is not supported (the recorded "
                "top-K lists would miss it)"
            )
    if (gc.num_beams or 1) > 1:
        raise ConfigError("MasktrlGRPOTrainer: beam search is not sampling; num_beams must be 1")
    out = LogitsProcessorList()
    if not gc.do_sample:
        return out
    if gc.temperature is not None and gc.temperature != 1.0:
        out.append(TemperatureLogitsWarper(gc.temperature))
    if gc.top_k is not None and gc.top_k != 0:
        out.append(TopKLogitsWarper(top_k=gc.top_k, min_tokens_to_keep=1))
    if gc.top_p is not None and gc.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=gc.top_p, min_tokens_to_keep=1))
    if gc.min_p is not None:
        out.append(MinPLogitsWarper(min_p=gc.min_p, min_tokens_to_keep=1))
    return out


class TopKRecorder(LogitsProcessor):
    """A logits processor that records, per generation step, the top-``k`` ids and log-probabilities
    of the distribution sampled from (``warpers`` applied to a copy of the scores) and, one step
    later, the log-probability of the token sampled; returns the scores unchanged."""

    def __init__(self, k: int, warpers: LogitsProcessorList):
        self.k, self.warpers = k, warpers
        self.ids: list[Tensor] = []
        self.logp: list[Tensor] = []
        self.sampled: list[Tensor] = []
        self._last: Tensor | None = None  # [B, V] log-softmax of the previous step
        self._start: int | None = None

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self._start is None:
            self._start = input_ids.shape[1]
        else:
            self._take(input_ids[:, -1])
        warped = self.warpers(input_ids, scores.clone())
        lp = torch.log_softmax(warped.float(), dim=-1)
        values, ids = lp.topk(min(self.k, lp.shape[-1]), dim=-1)
        self.ids.append(ids)
        self.logp.append(values)
        self._last = lp
        return scores

    def _take(self, tokens: Tensor) -> None:
        self.sampled.append(self._last.gather(1, tokens.long().unsqueeze(1)).squeeze(1))
        self._last = None

    def finish(self, sequences: Tensor) -> dict[str, Tensor]:
        """The lists of a finished ``generate`` call (``sequences``: what it returned): [B, T] the
        sampled tokens' log mu, [B, T, K] the ids and their log mu, T the steps generated."""
        if self._last is not None:
            self._take(sequences[:, self._start + len(self.sampled)])
        if not self.ids:
            b, dev = sequences.shape[0], sequences.device
            return {
                "behavior_logp": torch.zeros(b, 0, device=dev),
                "behavior_topk_ids": torch.zeros(b, 0, self.k, dtype=torch.long, device=dev),
                "behavior_topk_logp": torch.zeros(b, 0, self.k, device=dev),
            }
        return {
            "behavior_logp": torch.stack(self.sampled, 1),
            "behavior_topk_ids": torch.stack(self.ids, 1),
            "behavior_topk_logp": torch.stack(self.logp, 1),
        }


class MasktrlGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` training with a masktrl rule (module docstring).

    ``method``: a spec string (``pdm``, ``dppo:divergence=topk-tv``, ``path/to/rules.py:name``) or a
    ``BoundMethod``; ``correction``: a ``method.correction`` block; ``logprobs_k``: the length of the
    recorded top-K lists (the rollout's ``logprobs_k``); every other argument is ``GRPOTrainer``'s."""

    def __init__(self, *args, method: Any = "grpo", correction: dict | None = None, logprobs_k: int = 20, **kwargs):
        if not hasattr(GRPOTrainer, "_generate_single_turn"):
            raise ConfigError(
                "MasktrlGRPOTrainer needs TRL >= 1.16 (GRPOTrainer._generate_single_turn); pip install -e '.[trl]'"
            )
        self.masktrl_method = bind(method, correction)
        if isinstance(logprobs_k, bool) or not isinstance(logprobs_k, int) or logprobs_k < 1:
            raise ConfigError(f"MasktrlGRPOTrainer: logprobs_k must be a positive integer, got {logprobs_k!r}")
        if self.masktrl_method.kl_in_loss:
            raise ConfigError(
                "MasktrlGRPOTrainer: a rule with kl_coef > 0 in the loss is not supported; use "
                "GRPOConfig.beta for the reference KL"
            )
        self.logprobs_k = logprobs_k
        self.masktrl_needs_topk = needs_topk(self.masktrl_method)
        self._recorded: dict[str, Tensor] | None = None
        super().__init__(*args, **kwargs)
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
            raise ConfigError(
                f"MasktrlGRPOTrainer: GRPOConfig.temperature must be a finite number > 0 (the policy's log-probs "
                f"are computed at logits / temperature), got {temperature!r}"
            )
        if self.use_vllm or getattr(self, "use_transformers_continuous_batching", False):
            raise ConfigError(
                "MasktrlGRPOTrainer records the behaviour during transformers generate; "
                "vLLM and continuous batching are not supported (docs/ECOSYSTEM.md)"
            )
        if getattr(self, "tools", None):
            raise ConfigError(
                "MasktrlGRPOTrainer: tool calling is not supported (the tool's tokens have no behaviour log-probs)"
            )
        if getattr(self, "rollout_func", None) is not None:
            raise ConfigError("MasktrlGRPOTrainer: a rollout_func is not supported (it returns no top-K lists)")

    # ------------------------------------------------------------------ generation: record mu

    def _generate_single_turn(self, *args, **kwargs):
        model = self.accelerator.unwrap_model(self.model_wrapped)  # what unwrap_model_for_generation yields
        original = model.generate
        recorded: dict[str, Tensor] = {}

        def generate(*args, **kwargs):
            gc = kwargs.get("generation_config") or model.generation_config
            recorder = TopKRecorder(self.logprobs_k, sampling_warpers(gc))
            given = kwargs.pop("logits_processor", None) or LogitsProcessorList()
            out = original(*args, logits_processor=LogitsProcessorList([*given, recorder]), **kwargs)
            recorded.update(recorder.finish(out))
            return out

        model.generate = generate
        try:
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
        finally:
            del model.generate
        self._recorded = recorded
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        self._recorded = None
        output = super()._generate_and_score_completions(inputs)
        rec = self._recorded
        if rec is None:
            raise ConfigError("MasktrlGRPOTrainer: generation recorded no behaviour log-probs")
        width = output["completion_ids"].shape[1]
        device = output["completion_ids"].device
        for key in BEHAVIOUR_KEYS:
            value = rec[key].to(device)[:, :width]
            if value.shape[1] < width:  # cannot happen for generate's own output; pad as masked
                pad = [0, 0] * (value.dim() - 2) + [0, width - value.shape[1]]
                value = torch.nn.functional.pad(value, pad, value=-1 if key == "behavior_topk_ids" else float("-inf"))
            output[key] = value
        if self.masktrl_method.correction.needs_old:
            with torch.no_grad():
                old = self._masktrl_forward(self.model, output, need_grad=False)
            output["old_logp"], output["old_topk_logp"] = old["logp"], old["topk_logp"]
        return output

    # ------------------------------------------------------------------ the loss

    def _masktrl_forward(self, model, inputs: dict, need_grad: bool = True) -> dict[str, Tensor]:
        """log pi at the sampled and the listed ids [B, T] / [B, T, K], the entropy and sum pi^2 [B, T]."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        t = completion_ids.shape[1]
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -t - 1 : -1]
        lp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        ids = inputs["behavior_topk_ids"]
        out = {
            "logp": lp.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1),
            "topk_logp": lp.detach().gather(-1, ids.clamp_min(0)),
            "vocab_size": lp.shape[-1],
        }
        if need_grad:
            p = lp.exp()
            out["entropy"] = -(p * lp).sum(-1) if self.masktrl_method.needs_entropy_grad else -(p * lp).detach().sum(-1)
            out["pi_sq_sum"] = p.detach().pow(2).sum(-1).clamp(0.0, 1.0)
        return out

    def masktrl_loss(self, model, inputs: dict):
        """(the rule's scalar loss on ``inputs``, its ``RuleLoss``): TRL's batch dict plus the recorded lists."""
        method = self.masktrl_method
        fw = self._masktrl_forward(model, inputs)
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        mask = mask & (inputs["behavior_logp"] > float("-inf"))
        batch = padded_token_batch(
            fw["logp"],
            inputs["behavior_logp"],
            inputs["completion_ids"],
            mask,
            topk_ids=inputs["behavior_topk_ids"],
            topk_behavior_logp=inputs["behavior_topk_logp"],
            topk_logp=fw["topk_logp"],
            pi_sq_sum=fw["pi_sq_sum"] if method.needs_full_pi else None,
            vocab_size=fw["vocab_size"],
        )
        adv = token_advantages(inputs["advantages"].float(), mask)
        old = (inputs["old_logp"][mask], inputs["old_topk_logp"][mask]) if method.correction.needs_old else None
        u = self._uniforms(batch.n) if method.needs_u else None
        return rule_loss(
            method, batch, adv, horizon=self.max_completion_length, old=old, u=u, entropy=fw["entropy"][mask]
        )

    def _uniforms(self, n: int) -> Tensor:
        """SIS's uniforms: one stream per (seed, optimizer step, micro-batch)."""
        return keyed_uniforms(f"{self.args.seed}:{self.state.global_step}:{getattr(self, '_step', 0)}", n)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        out = self.masktrl_loss(model, inputs)
        loss = out.loss
        if mode == "train":
            loss = loss / getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        valid = out.batch.valid
        if valid.any():
            masked = (out.losses.mask & valid).float().sum() / valid.float().sum()
            self._metrics[mode]["masktrl/masked_frac"].append(self.accelerator.gather(masked.detach()).mean().item())
        return loss
