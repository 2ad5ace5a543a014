"""Typed, frozen, validated experiment configuration.

Precedence: dataclass defaults < YAML presets (``--config``, repeatable) < command line
(``--method``, ``--seed``, ``--set a.b=value``). Everything is validated once, at load; an
invalid value, a wrong type or an unknown key raises ``ConfigError`` naming the dotted key.

Presets compose: ``--config base.yaml --config overlay.yaml`` reads the files in order and a
later file overrides an earlier one key by key (``merge_config``), so a recipe is a base per
model size plus a small overlay (``configs/methods/<method>.yaml``). Lists are replaced
whole; a ``method`` block that names another method replaces the method and its parameters,
one without a name (or with the same) changes only the parameters it lists.

Every number is checked: floats must be finite (YAML reads ``1e400`` as inf and ``.nan`` as
NaN), integers must lie in [-MAX_INT, MAX_INT] (the seed in [0, MAX_SEED]), and each key has
its own range.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from masktrl.errors import ConfigError, MasktrlError
from masktrl.io import atomic_write_text
from masktrl.method_spec import MethodSpec, method_from_block
from masktrl.readers import read_json, read_yaml, yaml_value

if typing.TYPE_CHECKING:
    from masktrl.methods import BoundMethod

PRESETS = Path(__file__).resolve().parent.parent / "configs"  # the presets shipped with the source tree
DEFAULT_CONFIG = PRESETS / "tiny.yaml"
MAX_INT = 2**31 - 1
"""The largest integer any config key accepts (sizes, counts, steps)."""
MAX_SEED = 2**32 - 1
"""The largest seed: what every generator seeded from it (torch, numpy, python) accepts."""
MIN_TEMPERATURE = 1e-5
"""The lowest sampling temperature: below it sampling is greedy decoding but for ties, and far
below it logits / T overflow float32 (1e-320 is 0 in float32) and sample NaN."""
EVAL_BENCHMARKS = ("task", "synthetic", "aime24", "aime25", "aime", "math500", "gsm8k")
"""`masktrl eval` benchmarks: task (alias synthetic) = the run's own held-out
split of a synthetic task; aime = aime24 + aime25."""
OWN_TASK_BENCHMARKS = ("task", "synthetic")
"""The benchmark names of a run's own task: its fixed held-out split (synthetic is the older name, kept)."""
SYNTHETIC_TASKS = ("arithmetic", "residues", "longtail", "kb")
"""The built-in synthetic tasks: a held-out split drawn once with a fixed seed (masktrl/tasks/synthetic.py)."""
LR_SCHEDULES = ("constant", "linear", "cosine")
ADAMW_KERNELS = ("foreach", "fused")
TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
"""train.report_to: accelerate's trackers masktrl logs to (besides metrics.jsonl, the source of truth)."""
ROLLOUT_STORE = ("all", "resume")
HF_QUANTIZATIONS = ("fp8", "fp8-act", "fp8-full")
"""rollout.quantization with the hf engine: FP8 faked on its low-precision copy (models/lowprec.py)."""
HF_ONLY_QUANTIZATIONS = ("fp8-act", "fp8-full")
AUTO_LONG_TOKENS = 128
"""rollout.max_new_tokens from which ``auto`` turns on the long-response paths, rollout.drop_finished
and train.packing: at 6 new tokens they give nothing measurable, at 512 a 1.6x shorter step
(docs/BENCHMARKS.md §1); below it ``auto`` keeps the fixed-batch loop and the padded forward."""
PACKING_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama", "mistral", "phi3", "olmo2", "gpt_neox")
"""transformers ``model_type``s whose attention layers dispatch through transformers' attention
interface, so the packed forward can replace it (models/packing.py; tests/test_auto_long_paths.py
checks each class): what ``train.packing: auto`` reads a model folder's config.json against."""
TINY_PACKING = ("qwen3", "llama", "qwen2", "qwen3-moe", "phi3", "olmo2", "gpt-neox")
"""The tiny architectures that can be packed (full causal attention in every layer; mistral's
tiny model has a sliding window, gemma2/3 sliding layers); tests/test_auto_long_paths.py checks
it against models/packing.py."""
TINY_TOKENIZERS = ("char", "numbers", "words")
TINY_ARCHITECTURES = (
    "qwen3",
    "llama",
    "qwen2",
    "qwen3-moe",
    "mistral",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "gpt-neox",
)
MOE_ARCHITECTURES = ("qwen3-moe",)
"""The tiny architectures with mixture-of-experts layers: the ones
model.num_experts and model.experts_per_token apply to."""
MOE_DEFAULTS = {"num_experts": 8, "experts_per_token": 2}
"""The tiny MoE model's experts per layer and top-k when model.num_experts /
experts_per_token are unset (configs/lab-moe.yaml)."""
"""model.architecture: the names of ``masktrl.models.architectures.ARCHITECTURES`` (a test keeps them equal)."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int | None = None
    """LoRA adapters on the policy (needs peft: pip install 'masktrl[lora]'): the adapter rank r;
    null = off (the whole model trains). docs/MODELS.md."""
    alpha: float = 16.0
    """LoRA: the update is (alpha / rank) B A."""
    dropout: float = 0.0
    """LoRA: dropout on the adapters' input, in [0, 1)."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """LoRA: the module names to adapt (last part of the name, e.g. q_proj,v_proj), or all-linear:
    every linear layer but the output head."""

    def validate(self) -> None:
        if self.rank is not None and self.rank <= 0:
            raise ConfigError(f"model.lora.rank must be a positive integer (or null: no LoRA), got {self.rank}")
        _positive("model.lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules or not all(self.target_modules):
            raise ConfigError(
                f"model.lora.target_modules must name modules (or all-linear), got {list(self.target_modules)}"
            )


@dataclass(frozen=True)
class ModelConfig:
    path: str = "tiny"
    """'tiny' builds the embedded Qwen3-style model; otherwise a local folder or a hub id."""
    hidden_size: int = 128
    """Tiny model only: the hidden width."""
    num_layers: int = 3
    """Tiny model only: transformer layers."""
    num_heads: int = 4
    """Tiny model only: attention heads (must divide hidden_size)."""
    num_kv_heads: int = 2
    """Tiny model only: key/value heads of grouped-query attention (must divide num_heads)."""
    intermediate_size: int = 512
    """Tiny model only: the MLP's inner width."""
    dtype: str = "float32"
    """Training dtype: float32 | bfloat16 | float16."""
    chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template (instruct models)."""
    tokenizer: str = "char"
    """Tiny model only: 'char' (one token per character of the task's alphabet) or 'numbers' (one
    token per integer 0..1999 plus pad/eos/unk and '=': 2,004 tokens; for task residues, docs/LAB.md) or
    'words' (one token per whitespace-separated word of the task's alphabet; for task kb, the agentic
    lab, docs/TASKS.md)."""
    embedding_init: str = "random"
    """Tiny model only: 'random', or 'numbers' (the number tokens' input and output embeddings start
    with features of their value: residues mod 2..9, a band per hundred, low frequencies; needs
    model.tokenizer=numbers; docs/LAB.md)."""
    architecture: str = "qwen3"
    """Tiny model only: the transformers architecture it is built as: qwen3 | llama | qwen2 |
    qwen3-moe | mistral | gemma2 | gemma3 | phi3 | olmo2 | gpt-neox (docs/MODELS.md)."""
    num_experts: int | None = None
    """Tiny mixture-of-experts model only (model.architecture=qwen3-moe): experts per MoE layer
    (None: 8). Refused on a dense architecture."""
    experts_per_token: int | None = None
    """Tiny mixture-of-experts model only (model.architecture=qwen3-moe): the experts each token
    is routed to, top-k (None: 2; at most model.num_experts). Refused on a dense architecture."""
    max_positions: int | None = None
    """Tiny model only: the positions its context holds, prompt and response (None: 256). The
    200-token labs' answers fit 256; a longer response needs more (docs/LAB.md)."""
    routing_replay: str | None = None
    """Mixture-of-experts models only: 'rollout' replays the engine's routing in training (R3):
    the hf engine records the top-k experts of every prompt and response token in each MoE layer
    (a column of the rollout file) and the training forward sends each token to those experts,
    with gate weights recomputed from the trainer's router logits over them (as verl's
    router_replay and slime's --use-rollout-routing-replay); mismatch/routing_flip_rate is then 0
    by construction and mismatch/routing_flip_rate_router the rate without replay. None: off
    (the trainer routes by itself). Refused on a dense model, with rollout.engine=vllm (the
    engine cannot report its routing), train.packing, train.gradient_checkpointing and
    --rollouts-from files without recorded routing (docs/MODELS.md)."""
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> None:
        _choice("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.routing_replay is not None:
            _choice("model.routing_replay", self.routing_replay, ("rollout",))
        _choice("model.architecture", self.architecture, TINY_ARCHITECTURES)
        if self.path != "tiny" and self.architecture != "qwen3":
            raise ConfigError(
                "model.architecture is an option of the tiny model (model.path=tiny); a checkpoint has its own"
            )
        self.lora.validate()
        _choice("model.tokenizer", self.tokenizer, TINY_TOKENIZERS)
        _choice("model.embedding_init", self.embedding_init, ("random", "numbers"))
        if self.embedding_init == "numbers" and self.tokenizer != "numbers":
            raise ConfigError("model.embedding_init=numbers needs model.tokenizer=numbers")
        if self.path != "tiny" and (self.tokenizer, self.embedding_init) != ("char", "random"):
            raise ConfigError(
                "model.tokenizer and model.embedding_init are options of the tiny model (model.path=tiny)"
            )
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            _positive(f"model.{name}", getattr(self, name))
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ConfigError("model.num_heads must divide model.hidden_size and be a multiple of model.num_kv_heads")
        self._validate_experts()
        if self.max_positions is not None:
            if self.path != "tiny":
                raise ConfigError("model.max_positions is an option of the tiny model (model.path=tiny)")
            value = self.max_positions
            if isinstance(value, bool) or not isinstance(value, int) or not 8 <= value <= 65536:
                raise ConfigError(f"model.max_positions must be an integer in [8, 65536], got {value!r}")

    def _validate_experts(self) -> None:
        given = [k for k in MOE_DEFAULTS if getattr(self, k) is not None]
        if given and self.path != "tiny":
            raise ConfigError(
                f"model.{given[0]} is an option of the tiny model (model.path=tiny); a checkpoint has its own experts"
            )
        if given and self.architecture not in MOE_ARCHITECTURES:
            raise ConfigError(
                f"model.{given[0]} is a mixture-of-experts option, but "
                f"model.architecture={self.architecture} is dense "
                f"(MoE: {', '.join(MOE_ARCHITECTURES)})"
            )
        for k in given:
            value = getattr(self, k)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{k} must be an integer >= 1, got {value!r}")
        if self.moe_shape()[1] > self.moe_shape()[0]:
            raise ConfigError(
                f"model.experts_per_token={self.moe_shape()[1]} exceeds model.num_experts={self.moe_shape()[0]}"
            )

    def moe_shape(self) -> tuple[int, int]:
        """(experts per MoE layer, experts per token) of the tiny MoE model, defaults filled in."""
        return (
            self.num_experts or MOE_DEFAULTS["num_experts"],
            self.experts_per_token or MOE_DEFAULTS["experts_per_token"],
        )


DATASET_KEYS = (
    "source",
    "subset",
    "test_split",
    "prompt_key",
    "answer_key",
    "template",
    "system_prompt",
    "chat_template_kwargs",
    "reward",
    "max_prompt_tokens",
)
"""TaskConfig keys of dataset tasks (task.name dataset or a math preset); arithmetic takes none of them."""


@dataclass(frozen=True)
class TaskConfig:
    name: str = "arithmetic"
    """arithmetic (synthetic, built in), dataset (any dataset: task.source), or a math preset of it:
    dapo-math | math500 | gsm8k | aime | aime24 | aime25. See docs/TASKS.md."""
    ops: str = "+"
    """arithmetic: operations to draw from, any of '+-*'."""
    digits: int = 3
    """arithmetic: operands are uniform in [0, 10^digits)."""
    answer_format: str = "plain"
    """arithmetic: 'plain' (579</s>) or 'boxed' (\\boxed{579}</s>)."""
    n_test: int = 500
    """Size of the held-out split used for eval_before / eval_after."""
    data: str | None = None
    """Math presets: a local jsonl/json/parquet file (train prompts), read by the math field names."""
    source: str | None = None
    """dataset: a hub id (read from the local datasets cache, never downloaded) or a local
    .json/.jsonl/.parquet/.csv file or a folder of them (splits by file name)."""
    subset: str | None = None
    """dataset: the hub dataset's config name (e.g. main for openai/gsm8k)."""
    split: str = "train"
    """dataset: the split trained on (a single file is one split, whatever its name)."""
    test_split: str | None = None
    """dataset: the held-out split (default: n_test rows sampled from task.split, the rest train)."""
    prompt_key: str | None = None
    """dataset: dotted path of the prompt field (default prompt; a list of chat messages gives its
    last user message). Math presets: default the math field names (problem | question | ...)."""
    answer_key: str | None = None
    """dataset: dotted path of the reference answer (default answer), e.g. reward_model.ground_truth."""
    template: str | None = None
    """raw | base | instruct | dapo (DAPO-Math's own prompt), or a format string with {prompt} and
    any other {field} (dotted paths allowed; literal braces as {{ }}). Default: raw for dataset,
    base for the math presets (instruct with model.chat_template)."""
    system_prompt: str | None = None
    """A system message before the prompt (needs model.chat_template)."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of the tokenizer's apply_chat_template, e.g. {enable_thinking: false}."""
    reward: str | None = None
    """A registered reward (math-verify | answer-line | exact-match | boxed-match | your own),
    module:function or path/to/file.py:function. Default: the template's (base/instruct:
    math-verify, dapo: answer-line); required for dataset with the raw or a custom template."""
    reward_timeout_s: float = 5.0
    """Hard wall-clock limit per completion for the reward (custom rewards and math-verify)."""
    reward_workers: int = 2
    """Processes running the reward (custom rewards and math-verify)."""
    max_reward_error_frac: float = 0.5
    """Stop the run when, in one step, the reward failed (raised, timed out, returned no finite
    number) on more than this fraction of the completions; above 10% each such step warns.
    1.0: never stop."""
    max_prompt_tokens: int | None = None
    """Drop examples whose rendered prompt has more tokens than this."""
    options: dict = field(default_factory=dict)
    """residues and tasks added with register_task: further options of the task's factory, e.g.
    {answers: 4, distinct: true} for residues (docs/LAB.md; an unknown option is refused naming
    the accepted ones)."""
    env: str | None = None
    """Multi-turn, tool-using rollouts: the environment class, path/to/file.py:Class, module:Class
    or a shipped tool (masktrl.tasks.tools:Calculator | masktrl.tasks.tools:Search); the hf
    engine only. See docs/TASKS.md "Environments". null: single-turn."""
    call_stop: str | None = None
    """With task.env: the text that ends a tool call (a policy turn), e.g. </search>. Default: the
    environment class's ``stop`` attribute (the shipped tools: </calc>, </search>)."""
    max_turns: int | None = None
    """With task.env: the most policy turns of an episode (default 4)."""
    max_total_tokens: int | None = None
    """With task.env: the most response tokens of an episode, policy and environment tokens
    together (default max_turns * rollout.max_new_tokens); rollout.max_new_tokens bounds each turn."""
    env_timeout_s: float | None = None
    """With task.env: the wall-clock limit of one reset or step call (default 10); past it the
    episode ends and counts in env_timeouts."""

    def validate(self) -> None:
        _choice("task.answer_format", self.answer_format, ("plain", "boxed"))
        self._validate_env()
        if not self.ops or set(self.ops) - set("+-*"):
            raise ConfigError(f"task.ops must be a non-empty subset of '+-*', got {self.ops!r}")
        _positive("task.digits", self.digits)
        _positive("task.n_test", self.n_test)
        _timeout("task.reward_timeout_s", self.reward_timeout_s)
        _positive("task.reward_workers", self.reward_workers)
        if not 0.0 < self.max_reward_error_frac <= 1.0:
            raise ConfigError(f"task.max_reward_error_frac must be in (0, 1], got {self.max_reward_error_frac}")
        if self.max_prompt_tokens is not None:
            _positive("task.max_prompt_tokens", self.max_prompt_tokens)
        if self.name == "arithmetic":
            given = [k for k in DATASET_KEYS if getattr(self, k) not in (None, {})]
            if given:
                raise ConfigError(f"task.{given[0]} is an option of dataset tasks; task.name is arithmetic")
        if self.name == "dataset" and not self.source:
            raise ConfigError("task.name=dataset needs task.source: a hub id (local cache) or a local file or folder")

    def _validate_env(self) -> None:
        keys = ("call_stop", "max_turns", "max_total_tokens", "env_timeout_s")
        if self.env is None:
            given = [k for k in keys if getattr(self, k) is not None]
            if given:
                raise ConfigError(f"task.{given[0]} is an option of multi-turn tasks; set task.env")
            return
        if not isinstance(self.env, str) or ":" not in self.env:
            raise ConfigError(f"task.env must be path/to/file.py:Class or module:Class, got {self.env!r}")
        if self.call_stop is not None and (not isinstance(self.call_stop, str) or not self.call_stop):
            raise ConfigError(f"task.call_stop must be a non-empty string, got {self.call_stop!r}")
        for key in ("max_turns", "max_total_tokens"):
            if getattr(self, key) is not None:
                _positive(f"task.{key}", getattr(self, key))
        if self.env_timeout_s is not None:
            _timeout("task.env_timeout_s", self.env_timeout_s)


@dataclass(frozen=True)
class WarmStartConfig:
    steps: int = 2000
    """Supervised steps before RL (0 disables the warm start); with target_accuracy, the most."""
    batch_size: int = 128
    """Problems per supervised step."""
    lr: float = 3e-3
    """AdamW learning rate of the warm start, constant after the warm-up."""
    warmup_steps: int = 20
    """Steps of linear learning-rate warm-up at the start of the warm start."""
    target_accuracy: float | None = 0.5
    """Stop the warm start at the first check (every 100 steps) whose greedy accuracy on 256 fixed
    training problems (never held-out ones) reaches this; warmstart.steps is then the maximum.
    None (null in YAML): exactly warmstart.steps. The default 0.5 is above what the addition
    task's "always 4 digits" plateau can score (docs/NOTEBOOK_BENCHMARKS.md §1)."""

    def validate(self) -> None:
        _non_negative("warmstart.steps", self.steps)
        _positive("warmstart.batch_size", self.batch_size)
        check_lr("warmstart.lr", self.lr)
        _non_negative("warmstart.warmup_steps", self.warmup_steps)
        if self.target_accuracy is not None and not 0.0 < self.target_accuracy <= 1.0:
            raise ConfigError(f"warmstart.target_accuracy must be in (0, 1], got {self.target_accuracy}")


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "hf"
    """hf (transformers generate, CPU or GPU) | vllm."""
    prompts_per_step: int = 64
    """Prompts drawn per RL step; a step's batch is prompts_per_step x n responses."""
    n: int = 8
    """Samples per prompt: the group size G."""
    max_new_tokens: int = 6
    """Response length limit in tokens (a longer response is cut and counts as truncated)."""
    mask_truncated: bool = False
    """Responses cut at max_new_tokens get no gradient (their reward still enters
    the group baseline; TRL mask_truncated_completions)."""
    temperature: float = 1.0
    """Sampling temperature T (>= 1e-5); the recorded behaviour log-probs and the trained pi are both
    log_softmax(logits / T)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1: off); the recorded behaviour distribution is the truncated one,
    each token's kept set is recorded and training renormalises pi over it (docs/ROLLOUTS.md,
    "Truncated sampling"). Training needs the kept set to fit the top-K list: rollout.top_k <=
    rollout.logprobs_k, or a vocabulary of at most logprobs_k tokens."""
    top_k: int = 0
    """Sample among the top_k most likely tokens (0: off), before top_p; trained as top_p is
    (the kept set recorded, pi renormalised over it); at most rollout.logprobs_k for training."""
    logprobs_k: int = 20
    """K of the recorded behaviour top-K lists."""
    batch_size: int = 512
    """Sequences generated together by the hf engine (rollouts and evaluations)."""
    drop_finished: bool | str = "auto"
    """hf only: masktrl's own decode loop instead of transformers generate; a response that has
    ended (EOS or max_new_tokens) leaves the batch and the KV cache at once, so later steps run
    only the rows still generating (the same records, and for a seed the same tokens as generate
    up to the rounding of a smaller batch; docs/ROLLOUTS.md). auto: on with the hf engine,
    rollout.decode auto and rollout.max_new_tokens >= 128 (long responses), else off; a loaded
    config records what auto chose."""
    decode: str = "auto"
    """hf only: auto (fused, unless rollout.drop_finished runs its own loop) | generate
    (transformers generate) | fused (masktrl's fixed-batch decode loop, rollout/fused.py: the same
    forwards, draws and records as generate, bit-identical for one seed, without generate's
    per-step bookkeeping; docs/ROLLOUTS.md, "The fused decode loop")."""
    draw: str = "multinomial"
    """How masktrl's own decode loops (rollout.decode: fused, rollout.drop_finished) draw a sampled
    token: multinomial (torch.multinomial, as generate draws it) | inverse_cdf (one uniform per
    row against the cumulative probabilities: the same distribution, other samples for a seed,
    no per-token exponential draws; docs/ROLLOUTS.md)."""
    gpu_memory_utilization: float = 0.5
    """vllm only: the fraction of GPU memory vLLM may take (weights and KV cache)."""
    dtype: str | None = None
    """The precision the engine samples in: null (model.dtype: the engine samples from the model
    itself) | float32 | bfloat16 | float16. hf: a copy of the policy in this dtype, re-made at every
    weight sync, while training stays in model.dtype; vllm: its dtype (docs/ROLLOUTS.md)."""
    quantization: str | None = None
    """null | fp8 (weight-only e4m3, per output channel) | fp8-act (also the layers' inputs, per
    token) | fp8-full (also the output layer): hf fakes it on its copy of the policy; vllm takes
    its own methods (fp8, ...) as they are (docs/ROLLOUTS.md)."""
    enforce_eager: bool = False
    """vllm only: no CUDA graphs / compilation (slower; quicker start, needed by some CPU builds)."""
    sleep_mode: bool = False
    """vllm only (GPU): the engine sleeps between rollout and update (weights to CPU, KV cache freed)."""
    store: str = "all"
    """Which rollout batches a run keeps: all | resume (only those after the newest checkpoint,
    which --resume needs; earlier ones are deleted once a newer checkpoint is recorded)."""
    staleness: int | dict = 0
    """Rollout batches are sampled this many steps ahead: step S trains on a batch sampled by the
    policy after step S-1-staleness (the starting policy for the first ones), so even its first
    minibatch update is off-policy. 0: on-policy. Or a seeded distribution of batch ages under a
    cap, as asynchronous trainers produce: {dist: fixed | uniform | geometric, max: CAP, min: 0,
    p: 0.5} (uniform: min..max; geometric: P(a) = p (1-p)^(a-min), cut at max; fixed: max),
    drawn per step from the run's seed (docs/ROLLOUTS.md, "Batch ages"; metrics rollout_age).
    Not used with --rollouts-from."""
    partial: float | None = None
    """Partial rollouts: the probability that a weight sync lands while a batch sampled ahead
    (rollout.staleness > 0) is being generated, at a decode position drawn uniformly in
    1..max_new_tokens-1 from the run's seed; the tokens after it are sampled by the policy one
    step newer, on the prefix recomputed. null: off (no per-token versions stored). Each token's
    policy version is stored (column version; metrics rollout_token_age_*); hf engine, one
    process, single-turn, no routing replay (docs/ROLLOUTS.md, "Partial rollouts"). Not used
    with --rollouts-from."""
    mismatch: str = "auto"
    """The engine-trainer gap of every generated batch, mismatch/* (docs/ROLLOUTS.md): auto (measured;
    log pi_old from the update's own forward when it runs at the sampling weights: one process,
    staleness 0, train.minibatches 1 or a correction that computes pi_old; otherwise one extra
    forward without gradients) | always (that
    extra forward for every batch; the same numbers) | off (not measured, no extra forward)."""

    def __post_init__(self):
        if self.drop_finished == "auto":  # resolved once: a loaded config, and run.yaml, hold true or false
            long = isinstance(self.max_new_tokens, int) and self.max_new_tokens >= AUTO_LONG_TOKENS
            object.__setattr__(self, "drop_finished", self.engine == "hf" and self.decode == "auto" and long)

    @property
    def decode_loop(self) -> str:
        """The hf engine's decode loop: ``generate``, ``fused`` or ``drop_finished`` (``auto`` is
        ``fused`` unless ``drop_finished`` is on; another engine: ``generate``, unused)."""
        if self.engine != "hf":
            return "generate"
        if self.drop_finished:
            return "drop_finished"
        return "generate" if self.decode == "generate" else "fused"

    def validate(self) -> None:
        _choice("rollout.engine", self.engine, ("hf", "vllm"))
        _choice("rollout.store", self.store, ROLLOUT_STORE)
        if self.dtype is not None:
            _choice("rollout.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.quantization is not None:
            if self.engine == "hf":
                _choice("rollout.quantization", self.quantization, HF_QUANTIZATIONS)
            elif self.quantization in HF_ONLY_QUANTIZATIONS:
                raise ConfigError(
                    f"rollout.quantization={self.quantization} is an option of the hf engine "
                    "only; "
                    "vLLM's own fp8 already quantises activations on GPUs with FP8 "
                    "support (use fp8)"
                )
        if self.drop_finished and self.engine != "hf":
            raise ConfigError(
                "rollout.drop_finished is an option of the hf engine, got "
                f"rollout.engine={self.engine} "
                "(vLLM schedules finished sequences out of its batch itself)"
            )
        if not isinstance(self.drop_finished, bool):
            raise ConfigError(f"rollout.drop_finished must be true, false or auto, got {self.drop_finished!r}")
        _choice("rollout.decode", self.decode, ("auto", "generate", "fused"))
        _choice("rollout.draw", self.draw, ("multinomial", "inverse_cdf"))
        if self.decode == "fused" and self.engine != "hf":
            raise ConfigError(f"rollout.decode=fused is an option of the hf engine, got rollout.engine={self.engine}")
        if self.decode == "fused" and self.drop_finished:
            raise ConfigError(
                "rollout.decode=fused and rollout.drop_finished=true are two decode loops; set one of them"
            )
        if self.draw != "multinomial" and self.decode_loop == "generate":
            raise ConfigError(
                f"rollout.draw={self.draw} needs masktrl's own decode loop: rollout.engine=hf with "
                "rollout.decode=fused (or auto) or rollout.drop_finished=true"
            )
        if self.sleep_mode and self.engine != "vllm":
            raise ConfigError(f"rollout.sleep_mode needs rollout.engine=vllm, got {self.engine!r}")
        for name in ("prompts_per_step", "n", "max_new_tokens", "logprobs_k", "batch_size"):
            _positive(f"rollout.{name}", getattr(self, name))
        check_temperature("rollout.temperature", self.temperature)
        _non_negative("rollout.top_k", self.top_k)
        check_staleness(self.staleness)
        check_partial(self)
        _choice("rollout.mismatch", self.mismatch, ("auto", "always", "off"))
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.n < 2:
            raise ConfigError("rollout.n must be >= 2: group-normalised advantages need a group")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


STALENESS_DISTS = ("fixed", "uniform", "geometric")
"""rollout.staleness's distributions of batch ages (rl/schedule.py draws them)."""
STALENESS_KEYS = ("dist", "max", "min", "p")


def check_staleness(value: Any) -> None:
    """ConfigError naming rollout.staleness unless it is an integer >= 0 or a mapping
    {dist, max, min (default 0), p (geometric, default 0.5)} with 0 <= min <= max."""
    key = "rollout.staleness"
    if not isinstance(value, dict):
        _non_negative(key, value)
        return
    unknown = sorted(set(value) - set(STALENESS_KEYS))
    if unknown:
        raise ConfigError(f"{key}: unknown key {unknown[0]!r} (accepted: {', '.join(STALENESS_KEYS)})")
    if "dist" not in value or "max" not in value:
        raise ConfigError(
            f"{key} as a mapping needs dist ({' | '.join(STALENESS_DISTS)}) and max (the cap on a batch's age)"
        )
    _choice(f"{key}.dist", value["dist"], STALENESS_DISTS)
    for name in ("max", "min"):
        v = value.get(name, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT:
            raise ConfigError(f"{key}.{name} must be an integer >= 0, got {v!r}")
    if value["max"] < value.get("min", 0):
        raise ConfigError(f"{key}: the cap max={value['max']} is below the minimum age min={value['min']}")
    p = value.get("p", 0.5)
    if "p" in value and value["dist"] != "geometric":
        raise ConfigError(f"{key}.p is the geometric distribution's parameter; dist is {value['dist']}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ConfigError(f"{key}.p must be in (0, 1], got {p!r}")


def check_partial(r: Any) -> None:
    """ConfigError naming rollout.partial unless it is null or a number in (0, 1] used where a
    weight sync can land mid-generation: rollout.staleness > 0 (only batches sampled ahead have a
    newer policy before they are trained on), max_new_tokens >= 2, the hf engine."""
    p = r.partial
    if p is None:
        return
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ConfigError(f"rollout.partial must be a probability in (0, 1] or null, got {p!r}")
    if _cap(r.staleness) == 0:
        raise ConfigError(
            "rollout.partial needs rollout.staleness > 0: only a batch sampled ahead has a newer "
            "policy to switch to before it is trained on"
        )
    if r.max_new_tokens < 2:
        raise ConfigError("rollout.partial needs rollout.max_new_tokens >= 2: a sync lands between two tokens")
    if r.engine != "hf":
        raise ConfigError(f"rollout.partial needs rollout.engine=hf, got {r.engine!r}")


def _cap(staleness: Any) -> int:
    return int(staleness["max"]) if isinstance(staleness, dict) else int(staleness)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 800
    """RL steps (one rollout batch each)."""
    lr: float = 3e-4
    """AdamW learning rate of the RL updates (after the warm-up; no decay)."""
    minibatches: int = 1
    """Optimizer updates per rollout batch: the batch's sequences, in a random order, cut into parts
    of ceil(N / minibatches) (torch's chunk), so where minibatches does not divide N there can be
    fewer updates (30 on 512 sequences: 28 parts of 18 and one of 8, 29 updates; ``--dry-run``
    reports it and the run warns)."""
    minibatch_groups: bool | int = False
    """Split the batch into minibatches of whole prompt groups (all of a prompt's samples in one
    minibatch, the groups in a random order each step) instead of single samples in a random
    order. The shared-prompt forward then runs each prompt of a minibatch once: fewer tokens per
    update, the same loss per token. Another run, not the same one: a minibatch holds fewer
    prompts with more samples each; on the lab grpo learned less with it, a declared difference on
    two machines (docs/RESULTS.md §3, §5; docs/CLUSTER.md, "Minibatches of whole groups"). An
    integer g cuts each group into parts of g samples and shuffles the parts instead
    (g at least the group size: the same as true), so g sets how many prompts an update sees
    between single samples and whole groups."""
    grad_accum: int = 1
    """Micro-batches per optimizer update, per process: each process's part of a minibatch is
    run forward/backward in this many pieces and the gradients are summed (memory, not maths:
    the loss is normalised by the whole minibatch, so the update does not depend on it)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adamw: str = "foreach"
    """How AdamW runs (rl/schedule.py): foreach (torch's multi-tensor kernels on CPU tensors, the
    same bits as its per-parameter loop; torch's own choice elsewhere) | fused (torch's fused
    kernel, one pass over each parameter: the same update up to float32 rounding, so another run
    of the same distribution; a third of foreach's time per step or less on a CPU, a few percent of
    a lab run, docs/BENCHMARKS.md §7).
    The RL updates only (the warm start keeps foreach: its cached checkpoint serves every run of
    the seed). fused is refused under DeepSpeed and FSDP2 launches, which it is not tested with."""
    grad_clip: float = 1.0
    """The gradient's global norm is clipped to this before every optimizer update."""
    warmup_steps: int = 0
    """RL steps of linear learning-rate warm-up (0: none); the rate rises once per optimizer update."""
    checkpoint_every: int = 100
    """Save a checkpoint every this many steps (and always at the end)."""
    eval_every: int = 0
    """Evaluate on the held-out split every this many steps (0: only before and after)."""
    eval_benchmarks: tuple[str, ...] = ()
    """Extra benchmarks evaluated every eval_every steps (see `masktrl eval`)."""
    logprob_chunk: int = 1024
    """Tokens per chunk when computing log-probabilities (bounds the [chunk, V] logits)."""
    threads: int = 1
    """torch CPU threads. 1 is safe; 2 is ~1.3x faster on an idle 2-core machine, far slower when shared."""
    lr_schedule: str = "constant"
    """After the warm-up: constant | linear | cosine (decaying to lr x min_lr_ratio at the last update)."""
    min_lr_ratio: float = 0.0
    """linear / cosine: the final learning rate as a fraction of train.lr."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of storing them."""
    packing: bool | str = "auto"
    """Padding-free training forward: the sequences of a micro-batch packed into one row, attention
    per sequence (models/packing.py); no compute on padding. Same log pi, losses and gradients as
    the padded forward up to summation order. Pays off with ragged, long responses; on very short
    ones the padded forward is as fast. auto: on when rollout.max_new_tokens >= 128 (long
    responses) and the model can pack (its architecture, no model.routing_replay), else off; a
    loaded config records what auto chose."""
    micro_batch_tokens: int | None = None
    """Form each process's micro-batches by a token budget instead of train.grad_accum's fixed
    count: at most this many tokens per forward (prompt + response less its last token; a prompt
    shared by a group counts once), longest sequences first, so similar lengths share a
    micro-batch. A sequence longer than the budget is trained alone (one warning line). The update
    is unchanged: the loss is normalised by the whole minibatch."""
    keep_checkpoints: int | None = None
    """Keep the newest N complete checkpoints (plus train.keep_steps); None keeps all."""
    keep_steps: tuple[int, ...] = ()
    """Checkpoints never deleted by train.keep_checkpoints (they are still written every checkpoint_every)."""
    report_to: tuple[str, ...] = ()
    """Live trackers besides metrics.jsonl: any of tensorboard, wandb, trackio, mlflow (none: no tracker)."""
    max_nonfinite_steps: int = 5
    """A step whose loss or gradient norm is not finite is skipped (no optimizer step) and counted
    (nonfinite_steps in metrics.jsonl); after this many consecutive skipped steps the run stops
    with status failed."""
    quantization: str | None = None
    """FP8 training (docs/MODELS.md, "FP8 training"): null (the trainer computes in model.dtype) |
    fp8 | fp8-act | fp8-full, the schemes of rollout.quantization: the trainer's forward uses the
    FP8 round trip of the same weights (and activations), with straight-through gradients into
    the float32 master weights, so trainer and engine are both FP8. See
    train.quantization_backend."""
    quantization_backend: str = "auto"
    """train.quantization's kernels: fake (the FP8 round trip computed in model.dtype, any device) |
    torchao (torchao's float8 training, a CUDA GPU with FP8 support and torchao installed; refused
    otherwise) | auto (torchao where both are there, else fake)."""
    lab_stats: bool = False
    """Record whether the methods can differ on this run: per step the behaviour's residual mass
    1 - mu(top-K) and unlisted sampled tokens, and at the update the tokens with D > 0.15 and where
    the ratio and Ddot rules disagree (metrics lab/*, summary lab_stats; docs/LAB.md)."""

    def __post_init__(self):
        object.__setattr__(self, "report_to", tuple(t for t in self.report_to if t != "none"))  # 'none' = no tracker

    def validate(self) -> None:
        if not isinstance(self.packing, bool):
            raise ConfigError(f"train.packing must be true, false or auto, got {self.packing!r}")
        for name in (
            "steps",
            "minibatches",
            "grad_accum",
            "checkpoint_every",
            "logprob_chunk",
            "threads",
            "max_nonfinite_steps",
        ):
            _positive(f"train.{name}", getattr(self, name))
        _choice("train.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _choice("train.adamw", self.adamw, ADAMW_KERNELS)
        if self.quantization is not None:
            _choice("train.quantization", self.quantization, HF_QUANTIZATIONS)
        _choice("train.quantization_backend", self.quantization_backend, ("auto", "fake", "torchao"))
        if self.micro_batch_tokens is not None:
            if (
                isinstance(self.micro_batch_tokens, bool)
                or not isinstance(self.micro_batch_tokens, int)
                or self.micro_batch_tokens < 1
            ):
                raise ConfigError(
                    "train.micro_batch_tokens must be a positive number of tokens (or unset), "
                    "got "
                    f"{self.micro_batch_tokens!r}"
                )
            if self.grad_accum != 1:
                raise ConfigError(
                    "train.micro_batch_tokens and train.grad_accum both set the micro-batches: set one of them"
                )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ConfigError(
                f"train.keep_checkpoints must be >= 1 (or unset to keep all), got {self.keep_checkpoints}"
            )
        for step in self.keep_steps:
            _positive("train.keep_steps", step)
        for tracker in self.report_to:
            _choice("train.report_to", tracker, (*TRACKERS, "none"))
        if len(set(self.report_to)) != len(self.report_to):
            raise ConfigError(f"train.report_to lists a tracker twice: {', '.join(self.report_to)}")
        check_lr("train.lr", self.lr)
        _non_negative("train.weight_decay", self.weight_decay)
        _positive("train.grad_clip", self.grad_clip)
        _non_negative("train.warmup_steps", self.warmup_steps)
        _non_negative("train.eval_every", self.eval_every)
        for bench in self.eval_benchmarks:
            _choice("train.eval_benchmarks", bench, EVAL_BENCHMARKS)
        if len(set(self.eval_benchmarks)) != len(self.eval_benchmarks):
            raise ConfigError(f"train.eval_benchmarks lists a benchmark twice: {', '.join(self.eval_benchmarks)}")


@dataclass(frozen=True)
class EvalConfig:
    greedy: bool = True
    """eval_before/eval_after: greedy decoding (True) or one sample at rollout temperature."""
    k: int = 4
    """train.eval_benchmarks: samples per problem (avg@k, pass@k, maj@k), drawn at the rollout
    temperature and top_p."""
    n_problems: int | None = None
    """train.eval_benchmarks: evaluate the first N problems of each benchmark (None: all)."""
    max_new_tokens: int | None = None
    """train.eval_benchmarks: response length (None: rollout.max_new_tokens)."""
    data: dict = field(default_factory=dict)
    """train.eval_benchmarks: local data file per math benchmark, e.g. {aime24: data/aime24.jsonl}
    (benchmarks without one come from the local `datasets` cache)."""

    def validate(self) -> None:
        _positive("eval.k", self.k)
        if self.n_problems is not None:
            _positive("eval.n_problems", self.n_problems)
        if self.max_new_tokens is not None:
            _positive("eval.max_new_tokens", self.max_new_tokens)
        for bench, path in self.data.items():
            _choice("eval.data", bench, tuple(b for b in EVAL_BENCHMARKS if b not in OWN_TASK_BENCHMARKS))
            if not isinstance(path, str) or not path:
                raise ConfigError(f"eval.data.{bench} must be a file path, got {path!r}")


@dataclass(frozen=True)
class Config:
    seed: int = 0
    """Names every random stream of the run: warm start, prompts, sampling, minibatch order, SIS uniforms."""
    method: MethodSpec = field(default_factory=lambda: method_from_block({"name": "grpo"}))
    """The method: its name (a registered rule, or path/to/rules.py:name), its parameters and its
    correction, e.g. {name: dppo, divergence: topk-tv} (``masktrl.method_spec``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        if self.train.packing == "auto":  # resolved once: a loaded config, and run.yaml, hold true or false
            object.__setattr__(self, "train", dataclasses.replace(self.train, packing=self._auto_packing()))

    def _auto_packing(self) -> bool:
        """``train.packing: auto``: on for long responses (``AUTO_LONG_TOKENS``) when nothing refuses
        it: no routing replay, and a model that can mask packed sequences (a tiny architecture in
        ``TINY_PACKING``, or a model folder whose config.json passes ``PACKING_MODEL_TYPES`` and
        ``layers_unpackable``). Read without importing the models (config sits below them); a
        model it cannot read this way is not packed."""
        long = isinstance(self.rollout.max_new_tokens, int) and self.rollout.max_new_tokens >= AUTO_LONG_TOKENS
        if not long or self.model.routing_replay is not None:
            return False
        if self.model.path == "tiny":
            return self.model.architecture in TINY_PACKING
        folder = Path(self.model.path)
        try:  # a model folder's config.json; a hub id, an adapter folder or an unreadable file: not packed
            config = read_json(folder / "config.json") if (folder / "config.json").is_file() else None
        except (MasktrlError, OSError):
            config = None
        if not isinstance(config, dict) or config.get("model_type") not in PACKING_MODEL_TYPES:
            return False
        return layers_unpackable(str(config["model_type"]), config) is None

    @property
    def method_name(self) -> str:
        """The rule's registered name (runs are named after it)."""
        return self.method.name

    def resolved_method(self) -> dict:
        """``method`` with every parameter at its value, defaults included: ``dppo`` and
        ``dppo`` with ``divergence: topk-kl`` (its default) resolve alike. An active correction
        (anything but kind none in bypass mode) is part of it, resolved the same way."""
        return self.method.resolved()

    def to_dict(self) -> dict:
        """The config as run.yaml records it: the method block as written (``MethodSpec.to_dict``)."""
        return {
            f.name: self.method.to_dict() if f.name == "method" else _as_dict(getattr(self, f.name))
            for f in dataclasses.fields(self)
        }

    def hash(self, *sections: str, exclude: tuple[str, ...] = ()) -> str:
        """sha256 of the whole config, or of the named sections only (e.g. the warm start's inputs),
        without the dotted keys of ``exclude``."""
        d = self.to_dict()
        for key in HASH_UNLESS_SET:  # unset, they are absent: the hashes of configs from before they existed stay
            section, name = key.split(".")
            if d[section].get(name) is None:
                d[section].pop(name, None)
        for key in exclude:
            section, name = key.split(".")
            d[section].pop(name, None)
        if sections:
            d = {s: d[s] for s in sections}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def layers_unpackable(name: str, config: Any) -> str | None:
    """Why a model whose attention dispatches through transformers' interface still cannot be
    packed, from its config (an object or a config.json mapping): a sliding window or a
    linear/recurrent layer would need the segment boundaries too. None when every layer attends
    fully and causally."""

    def get(key: str, default: Any = None) -> Any:
        return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)

    kinds = set(get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"{name} has {', '.join(sorted(kinds - {'full_attention'}))} layers, which cannot mask packed segments"
    if get("sliding_window") and get("use_sliding_window", True) is not False:
        return f"{name} uses sliding-window attention, which cannot mask packed segments"
    return None


def _as_dict(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)


HASH_UNLESS_SET = (
    "model.max_positions",
    "model.num_experts",
    "model.experts_per_token",
    "model.routing_replay",
    "rollout.partial",
    "task.env",
    "task.call_stop",
    "task.max_turns",
    "task.max_total_tokens",
    "task.env_timeout_s",
)
"""Keys that count in ``Config.hash`` (the warm-start cache's key among others) only when set."""


def load_config(
    paths: str | Path | list | tuple | None = None, overrides: list[str] | tuple[str, ...] = (), **direct: Any
) -> Config:
    """Defaults < YAML files in order (none given: configs/tiny.yaml) < ``direct`` (e.g.
    method="sis", seed=3) < ``key=value`` overrides; an override of a ``direct`` key to another
    value is a ConfigError (``--seed 1 --set seed=2``)."""
    if paths is None or isinstance(paths, (str, Path)):
        paths = [paths] if paths is not None else []
    raw: dict = {}
    if not paths and DEFAULT_CONFIG.exists():
        paths = [DEFAULT_CONFIG]
    for path in paths:
        raw = merge_config(raw, _read_yaml(config_path(path)))
    _refuse_conflicts(direct, overrides)
    for key, value in direct.items():
        if value is None:
            continue
        if key == "method":
            raw = merge_config(raw, {"method": {"name": value}})
        else:
            _set_dotted(raw, key, value)
    raw = read_overrides(None, overrides, raw)
    if isinstance(
        raw.get("method"), dict
    ):  # what a run recorded of its rule files: a request describes the files as they are now
        raw["method"].pop("sha256", None)
        if isinstance(raw["method"].get("correction"), dict):
            raw["method"]["correction"].pop("sha256", None)
    return from_dict(raw)


_FLAG_KEYS = {"seed": "seed", "method": "method", "method.name": "method"}  # --set key -> the flag it repeats


def _refuse_conflicts(direct: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    """ConfigError for a ``--set`` that gives another value than its own flag (``--seed 1 --set
    seed=2``, ``--method grpo --set method.name=dppo``): one of the two would be dropped silently.
    The same value twice is no conflict."""
    for item in overrides:
        key, _, text = item.partition("=")
        flag = _FLAG_KEYS.get(key.strip())
        given = direct.get(flag) if flag else None
        if given is not None and _parse_scalar(text, key.strip()) != given:
            raise ConfigError(f"--set {item} conflicts with --{flag} {given}: drop one")


def read_overrides(
    path: str | Path | list | tuple | None = None, overrides: list[str] | tuple[str, ...] = (), raw: dict | None = None
) -> dict:
    """``raw`` (default: empty) updated with the YAML file(s) ``path`` (several compose as in
    ``load_config``) and the ``key=value`` overrides: the raw mapping, without defaults and not
    yet validated (``from_dict`` does that)."""
    raw = dict(raw or {})
    for p in [] if path is None else [path] if isinstance(path, (str, Path)) else path:
        raw = merge_config(raw, _read_yaml(config_path(p)))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value")
        value = _parse_scalar(text, key.strip())
        if isinstance(value, (dict, list, bool)) and _is_text_key(key.strip()):
            value = text  # a text key keeps its text: --set task.template={prompt} is not a YAML mapping
        _set_dotted(raw, key.strip(), value)
    return raw


def from_dict(raw: dict) -> Config:
    cfg = _section(Config, raw, "")
    check_seed("seed", cfg.seed)
    for section in (cfg.model, cfg.task, cfg.warmstart, cfg.rollout, cfg.train, cfg.eval):
        section.validate()
    batch, parts = cfg.rollout.prompts_per_step * cfg.rollout.n, cfg.train.minibatches * cfg.train.grad_accum
    if parts > batch:  # each minibatch, and each of its micro-batches, needs a sequence at least
        raise ConfigError(
            f"train.minibatches={cfg.train.minibatches} x train.grad_accum={cfg.train.grad_accum} needs at least "
            f"{parts} sequences a step, but a step has rollout.prompts_per_step x rollout.n = {batch}: lower "
            "train.minibatches or train.grad_accum, or raise rollout.prompts_per_step"
        )
    sis_k = getattr(cfg.method.params, "k", None) if cfg.method.rule == "sis" else None
    if sis_k is not None and sis_k > cfg.rollout.logprobs_k:
        raise ConfigError(
            f"method.k={sis_k} is above rollout.logprobs_k={cfg.rollout.logprobs_k}: SIS re-cuts "
            "the "
            "stored behaviour "
            "lists and cannot make them longer (record more with "
            "rollout.logprobs_k)"
        )
    if cfg.model.tokenizer == "numbers" and cfg.task.name != "residues":
        raise ConfigError(f"model.tokenizer=numbers cannot encode task {cfg.task.name!r} (it serves task residues)")
    if cfg.task.env is not None and (cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0):
        raise ConfigError(
            "task.env (multi-turn rollouts) samples the whole vocabulary: set rollout.top_p=1 and rollout.top_k=0"
        )
    own = [b for b in cfg.train.eval_benchmarks if b in OWN_TASK_BENCHMARKS]
    if own and cfg.task.name not in SYNTHETIC_TASKS:
        raise ConfigError(
            f"train.eval_benchmarks: {own[0]} is the run's own synthetic task "
            f"({', '.join(SYNTHETIC_TASKS)}), "
            f"but task.name is {cfg.task.name!r}"
        )
    return cfg


def merge_config(base: dict, overlay: dict) -> dict:
    """``overlay`` on top of ``base`` (raw YAML mappings), key by key; a new dict.

    Mappings merge recursively, anything else (lists included) is replaced. A ``method`` block
    naming another method than ``base``'s replaces it whole: the parameters of one method mean
    nothing to another."""
    out = dict(base)
    for key, value in overlay.items():
        old = out.get(key)
        if (
            key == "method"
            and isinstance(value, dict)
            and isinstance(old, dict)
            and value.get("name", old.get("name")) != old.get("name")
        ):
            out[key] = dict(value)
        elif isinstance(value, dict) and isinstance(old, dict):
            out[key] = merge_config(old, value)
        else:
            out[key] = value
    return out


def save_config(cfg: Config, path: Path) -> None:
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def diff_configs(a: Config, b: Config, ignore: tuple[str, ...] = ()) -> list[str]:
    """Dotted keys whose values differ."""
    fa, fb = flatten(a.to_dict()), flatten(b.to_dict())
    keys = sorted(set(fa) | set(fb))
    return [k for k in keys if fa.get(k) != fb.get(k) and not k.startswith(ignore)]


# --------------------------------------------------------------------------- documentation


@dataclass(frozen=True)
class KeyDoc:
    """One config key as ``masktrl config keys`` lists it."""

    key: str
    type: str
    default: Any
    doc: str


def config_keys(method: str | None = None) -> list[KeyDoc]:
    """Every config key with its type, default and documentation: the sections' fields, then
    ``method.name`` and the parameters of ``method`` (default: grpo) from the method registry.

    The documentation is each field's docstring in this module (or in ``masktrl.methods.params``)."""
    from masktrl.methods import method_names

    keys = [KeyDoc("seed", "int", Config.seed, field_docs(Config)["seed"])]
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        if dataclasses.is_dataclass(cls) and cls is not MethodSpec:
            keys += _class_keys(cls, section.name)
    name = Config().method_name if method is None else method
    params_cls = method_from_block({"name": name}).method.params_cls  # an unknown name: one ConfigError line
    keys.append(
        KeyDoc(
            "method.name",
            "str",
            Config().method_name,
            f"The method: {' | '.join(method_names())}, or path/to/rules.py:name (a rule of your own).",
        )
    )
    keys += _class_keys(params_cls, "method")
    from masktrl.methods import CorrectionParams

    keys += _class_keys(CorrectionParams, "method.correction")  # every method takes the correction block (§14)
    return keys


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field docstrings (the string literal under each field), by field name."""
    return dict(_field_docs(cls))


@functools.cache
def _field_docs(cls: type) -> tuple[tuple[str, str], ...]:
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = []
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs.append((node.target.id, inspect.cleandoc(nxt.value.value)))
    return tuple(docs)


def _class_keys(cls: type, prefix: str) -> list[KeyDoc]:
    docs = {}  # a field's docstring is in the class that declares it (a method's regularisers: a base class)
    for base in reversed(cls.__mro__):
        if "__dataclass_fields__" in vars(base):
            docs.update(field_docs(base))
    hints, defaults = typing.get_type_hints(cls), cls()
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):  # a nested section (model.lora)
            keys += _class_keys(hints[f.name], f"{prefix}.{f.name}")
        else:
            keys.append(
                KeyDoc(
                    f"{prefix}.{f.name}",
                    _type_name(hints[f.name]),
                    f.default if isinstance(f.default, str) else getattr(defaults, f.name),  # auto, as declared
                    docs.get(f.name, ""),
                )
            )
    return keys


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if list(typing.get_args(tp)) == [bool, str]:  # true, false or auto
            return "bool | auto"
        if list(typing.get_args(tp)) == [bool, int]:  # true, false or a positive integer
            return "bool | int"
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return "list"
    return {dict: "mapping", type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


# --------------------------------------------------------------------------- helpers


def config_path(spec: str | Path) -> Path:
    """A ``--config`` argument as a file: the path as given, or else the name of a preset shipped in
    configs/ (``lab``, ``tiny``, ``qwen3-4b``, ``methods/pdm-agg``), so presets work from any folder."""
    path = Path(spec)
    if path.is_file() or path.suffix in (".yaml", ".yml"):
        return path
    preset = PRESETS / f"{spec}.yaml"
    return preset if preset.is_file() else path


def presets() -> list[str]:
    """The names ``--config`` takes for the shipped presets."""
    return sorted(
        p.relative_to(PRESETS).with_suffix("").as_posix()
        for p in PRESETS.rglob("*.yaml")
        if p.parent.name != "accelerate"
    )


def _read_yaml(path: Path) -> dict:
    """A config file, read with the bounded loader (``masktrl/readers.py``: a duplicate key,
    nesting deeper than 64 levels, a recursive alias or an alias bomb is one ConfigError line)."""
    if path.is_dir():
        raise ConfigError(f"config {path} is a folder: give a YAML file or a preset name")
    if not path.is_file():
        names = ", ".join(presets())
        raise ConfigError(
            f"config file not found: {path}"
            + (f" (shipped presets, by name from any folder: {names})" if names else "")
        )
    data = read_yaml(path, error=ConfigError)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def _is_text_key(key: str) -> bool:
    """Whether the dotted ``key`` names a ``str`` (or ``str | None``) field of Config."""
    cls: Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        cls = hints[part]
    return cls is str or set(typing.get_args(cls)) == {str, type(None)}


def _parse_scalar(text: str, key: str = "") -> Any:
    return yaml_value(text, f"--set {key}" if key else "--set", error=ConfigError)


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {part} is not a section")
    node[parts[-1]] = value


def _section(cls: type, raw: Any, prefix: str) -> Any:
    """The dataclass ``cls`` from the mapping ``raw`` (keys under
    ``prefix``), every value coerced to its field's type."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]} (valid: {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if tp is MethodSpec:
        # the rule, its params and its correction, validated once; 1e-3-style numbers read as numbers
        return method_from_block(_exponent_numbers(value) if isinstance(value, dict) else value)
    if dataclasses.is_dataclass(tp):
        return _section(tp, value, key + ".")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if args == [bool, str]:  # true, false or auto (rollout.drop_finished, train.packing)
            if value == "auto" or isinstance(value, bool):
                return value
            raise ConfigError(f"{key} must be true, false or auto, got {value!r}")
        if args == [bool, int]:  # true, false or a positive integer (train.minibatch_groups)
            if isinstance(value, bool) or (isinstance(value, int) and 1 <= value <= MAX_INT):
                return value
            raise ConfigError(f"{key} must be true, false or a positive integer, got {value!r}")
        if value is None and type(None) in typing.get_args(tp):
            return None
        if isinstance(value, dict) and dict in args:  # e.g. rollout.staleness: an integer or a mapping
            return dict(value)
        return _coerce(args[0], value, key)
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if isinstance(value, str):  # a,b,c: each item read as --set reads a value (train.keep_steps=50,100)
            value = [v.strip() if item_tp is str else _parse_scalar(v, key) for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_coerce(item_tp, v, key) for v in value)
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        if abs(value) > (MAX_SEED if key == "seed" else MAX_INT):
            raise ConfigError(f"{key} is out of range: {_digits(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an integer too large for a float
            raise ConfigError(f"{key} is out of range: {_digits(value)}") from None
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
        return value
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {tp}")


EXPONENT_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""A number in exponent form without a dot (``1e-3``, ``5e0``), which YAML 1.1 reads as text."""


def _exponent_numbers(section: dict) -> dict:
    """The ``method`` section with every ``1e-3``-style text read as the number it is, as the typed
    sections' float fields read it (``train.lr=1e-4``); nested blocks (``correction``) too."""

    def number(value):
        if isinstance(value, dict):
            return {k: number(v) for k, v in value.items()}
        if isinstance(value, str) and EXPONENT_NUMBER.fullmatch(value.strip()):
            return float(value)
        return value

    return number(dict(section))


def _digits(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"an integer of {len(text)} digits"


def flatten(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1} (tuples become lists)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key} must be one of {', '.join(options)}; got {value!r}")


def check_temperature(key: str, value: float, *, greedy: bool = False) -> None:
    """ConfigError unless ``value`` is a finite sampling temperature >= MIN_TEMPERATURE, or, with
    ``greedy``, 0 (greedy decoding)."""
    if greedy and value == 0:
        return
    if not (math.isfinite(value) and value >= MIN_TEMPERATURE):
        raise ConfigError(
            f"{key} must be a finite number >= {MIN_TEMPERATURE:g}"
            + (" or 0 (greedy)" if greedy else "")
            + f" (below it sampling is greedy decoding but for ties, and logits / T can overflow), got {value}"
        )


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key} must be > 0, got {value}")


MAX_LR = 1e30
"""The largest learning rate a key takes (far above any rate that trains: at 1e30 the weights
diverge and the run says so in one line): Adam's first step is lr / (1 - beta1) = 10 lr, which
past float32's range (lr 1e300, or 1e38) raised a RuntimeError inside the optimizer after the run
folder was made."""


def check_lr(key: str, value: float) -> None:
    """ConfigError unless the learning rate ``key`` names lies in (0, MAX_LR]."""
    _positive(key, value)
    if not value <= MAX_LR:
        raise ConfigError(f"{key} must be at most {MAX_LR:g}, got {value:g}")


MAX_TIMEOUT_S = 1e6
"""The longest wait a timeout key takes (about 11.6 days): a pipe's poll counts milliseconds in 32
bits (2^31 ms, 24.8 days) and a thread's join has its own limit; above them the wait raised
OverflowError from inside the run."""


def check_seed(key: str, value: int) -> None:
    """ConfigError unless the seed ``key`` names lies in [0, MAX_SEED] (numpy's seeding refuses a
    negative one with a traceback)."""
    if not 0 <= value <= MAX_SEED:
        raise ConfigError(f"{key} must be in [0, {MAX_SEED}], got {value}")


def _timeout(key: str, value: float) -> None:
    _positive(key, value)
    if value > MAX_TIMEOUT_S:
        raise ConfigError(f"{key} must be at most {MAX_TIMEOUT_S:.0e} s (about 11.6 days), got {value:g}")


def _non_negative(key: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{key} must be >= 0, got {value}")


def resolve_method_spec(spec: str, correction: dict | None = None) -> BoundMethod:
    """A method spec string as ``--methods`` takes it (``grpo``, ``pdm:tail=uniform``,
    ``path/to/rules.py:name``, ``path/to/rules.py:name:key=value``) as a bound method, its
    params at their defaults but for the ``key=value`` pairs; ``correction``: a
    ``method.correction`` block. One ``ConfigError`` line for anything wrong."""
    name, overrides = split_method(spec)
    raw = read_overrides(
        None, overrides, {"method": {"name": name, **({"correction": correction} if correction else {})}}
    )
    return method_from_block(raw["method"]).bind()


def split_method(spec: str) -> tuple[str, list[str]]:
    """``pdm:tail=uniform`` -> ("pdm", ["method.tail=uniform"]); a key may be dotted, for a block
    of the method section: ``grpo:correction.kind=token-tis`` -> ["method.correction.kind=token-tis"].
    A rule from a file: ``rules.py:soft:tau=2`` -> ("rules.py:soft", ["method.tau=2"])."""
    segments: list[str] = []
    for part in spec.split(":"):  # a value naming a file's rule (correction.kind=rules.py:name) keeps its colon
        if segments and "=" not in part and segments[-1].endswith(".py") and (len(segments) > 1 or "=" in segments[-1]):
            segments[-1] += f":{part}"
        else:
            segments.append(part)
    name, *pairs = segments
    if name.endswith(".py") and pairs:  # path/to/rules.py:name[:KEY=VALUE...]
        name, pairs = f"{name}:{pairs[0]}", pairs[1:]
    overrides: list[str] = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if (
            not sep
            or not key.strip()
            or not value.strip()
            or not key.strip().replace("_", "").replace(".", "").isalnum()
            or ".." in key
            or key.strip().startswith(".")
            or key.strip().endswith(".")
        ):
            raise ConfigError(f"--methods: {spec!r}: parameters go as NAME:KEY=VALUE (e.g. pdm:tail=uniform)")
        if any(o.startswith(f"method.{key.strip()}=") for o in overrides):
            raise ConfigError(f"--methods: {spec!r} gives {key.strip()} twice: give each parameter once")
        overrides.append(f"method.{key.strip()}={value.strip()}")
    return name.strip(), overrides
