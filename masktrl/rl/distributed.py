"""One process or many: what the train loop needs from ``accelerate launch``.

A plain ``masktrl train`` on a machine without a CUDA GPU gets ``Dist()``: rank 0 of 1, every
collective a no-op, the model and optimizer untouched (on the CPU), ``backward`` =
``loss.backward()``. That path is exactly the single-process trainer, bit for bit. A plain run
on a machine with a CUDA GPU gets a one-process ``Accelerator`` (``accelerated``), which puts
the policy and its optimizer on that GPU: without it the trainer would stay on the CPU beside an
idle GPU (``CUDA_VISIBLE_DEVICES=`` keeps such a run on the CPU).

Under ``accelerate launch`` (DDP, DeepSpeed ZeRO-2/3 or FSDP2, GPUs or nodes, or CPUs with gloo),
``Dist.from_launch(cfg.train)`` builds one ``accelerate.Accelerator`` and the loop uses it for:

* rank / world size / ``is_main`` (only the main process writes artifacts),
* ``prepare`` (wrap the policy and its optimizer), ``unwrap``, ``full_state_dict`` (ZeRO-3
  gathers the weights for ``save_pretrained``),
* DeepSpeed's sharded state for ``--resume`` (``save_engine_state`` / ``load_engine_state``:
  DeepSpeed's own ``engine.save_checkpoint`` format, one shard per process, checked against
  the launch by ``check_engine_state``),
* collectives on python objects and numbers (``gather_objects``, ``sum``, ``barrier``),
* gradient accumulation (``accumulate``/``backward``/``clip_grad_norm``): the loss handed to
  ``backward`` is already normalised by the whole batch (see ``rl/update.py``), so the
  ``1/grad_accum`` that accelerate and DeepSpeed apply is undone here.

FSDP2 (``distributed_type: FSDP``, ``fsdp_version: 2``, configs/accelerate/fsdp2.yaml) shards the
policy as one FSDP2 unit (``fsdp_auto_wrap_policy: NO_WRAP``): the optimizer state and the
gradients are sharded over the processes; the weights are gathered whole by every process after
each update (``whole``), so the rollout engine, the reference and the metrics read them as in a
plain run, and a checkpoint holds the full weights and the full optimizer state in masktrl's
ordinary format (resumable by any launch). accelerate (1.16) only turns FSDP on for an
accelerator device (``AcceleratorState``: the FSDP branch lists MULTI_GPU, MULTI_XPU, ..., not
MULTI_CPU); on CPUs (gloo) ``from_launch`` switches the MULTI_CPU state to FSDP with the
launch's plugin, and accelerate's own FSDP2 preparation (``fully_shard``) runs unchanged.

An invalid DeepSpeed JSON (``deepspeed_config_file`` of the accelerate config, passed on as
``ACCELERATE_DEEPSPEED_CONFIG_FILE``) or launch setting is a ``ConfigError`` naming the file
or setting, raised before anything is written.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from masktrl.errors import ArtifactError, ConfigError, MasktrlError
from masktrl.readers import read_json

DS_CONFIG_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
ENGINE_STATE_TAG = "zero"  # the sub-folder DeepSpeed writes its shards into, inside a checkpoint's deepspeed/


def launched() -> bool:
    """Whether this process was started by ``accelerate launch`` (or torchrun with several ranks)."""
    return "ACCELERATE_MIXED_PRECISION" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def launch_rank() -> int:
    """This process's global rank as the launcher set it (0 for a plain run), before any setup."""
    return int(os.environ.get("RANK", "0"))


def accelerated() -> bool:
    """Whether the trainer needs an ``Accelerator``: a launched process, or a plain run on a
    machine with a visible CUDA GPU (one process on that GPU)."""
    return launched() or torch.cuda.is_available()


class Dist:
    """A single process when ``accelerator`` is None, else one rank of an accelerate launch."""

    def __init__(self, accelerator=None):
        self.acc = accelerator
        if accelerator is None:
            self.rank, self.world, self.device = 0, 1, torch.device("cpu")
        else:
            # torch.distributed is the ground truth: Accelerator.num_processes was seen to say 1
            # per rank under DeepSpeed on CPU.
            dist = torch.distributed
            up = dist.is_available() and dist.is_initialized()
            self.rank = dist.get_rank() if up else accelerator.process_index
            self.world = dist.get_world_size() if up else accelerator.num_processes
            self.device = accelerator.device
        self.deepspeed = accelerator is not None and accelerator.state.deepspeed_plugin is not None
        self.zero3 = self.deepspeed and accelerator.state.deepspeed_plugin.zero_stage == 3
        self.fsdp2 = accelerator is not None and bool(getattr(accelerator, "is_fsdp2", False))
        self._raw_optimizer = None
        self._fsdp_root = None  # FSDP2: the prepared policy (one FSDP unit)

    @classmethod
    def from_launch(cls, train_cfg) -> Dist:
        """The Accelerator of this launch, configured from ``train_cfg`` (grad_accum, grad_clip)."""
        check_launch_settings()  # before DeepSpeed is even imported
        check_adamw(train_cfg.adamw, deepspeed=deepspeed_launch(), fsdp=_fsdp_launch())
        from accelerate import Accelerator

        # Without a GPU, accelerate only sets up gloo (MULTI_CPU) when told cpu=True; DeepSpeed
        # must not be told (cpu=True switches it off).
        cpu = not torch.cuda.is_available() and not deepspeed_launch()
        try:
            acc = Accelerator(gradient_accumulation_steps=train_cfg.grad_accum, cpu=cpu)
        except (ValueError, TypeError, KeyError, ImportError, OSError) as exc:
            raise ConfigError(
                f"{_launch_source()}: invalid accelerate/DeepSpeed settings ({_first_line(exc)})"
            ) from None
        if cpu and _fsdp_launch():
            _fsdp_on_cpu(acc)
        plugin = acc.state.deepspeed_plugin
        if plugin is not None:
            ds = plugin.deepspeed_config
            _check_zero_stage(ds.get("zero_optimization", {}).get("stage"))
            ds["train_micro_batch_size_per_gpu"] = 1  # one micro-batch = one forward; no dataloader to infer it from
            ds["gradient_accumulation_steps"] = train_cfg.grad_accum
            ds["gradient_clipping"] = train_cfg.grad_clip  # masktrl's config is authoritative
            ds.pop("train_batch_size", None)
        return cls(acc)

    # -- who am I
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def stream_key(self) -> tuple:
        """Appended to random-stream names that must differ per rank; empty for one process, so a
        plain run draws exactly what it always drew."""
        return () if self.world == 1 else ("rank", self.rank, "of", self.world)

    # -- model and optimizer
    def prepare(self, model, optimizer):
        if self.acc is None:
            return model, optimizer
        self._raw_optimizer = optimizer
        if self.zero3:  # the lm_head weight is used outside its module's forward (chunked logprobs)
            import deepspeed

            deepspeed.zero.register_external_parameter(model, model.lm.get_output_embeddings().weight)
        policy, optimizer = self.acc.prepare(model, optimizer)
        if self.fsdp2:
            self._fsdp_root = policy
            self.whole()
        return policy, optimizer

    def whole(self) -> None:
        """FSDP2: every process gathers the whole weights (one all-gather; every process must
        call). After ``prepare`` and after every update, so that the engine, the reference and
        the metrics, which call the LM outside the policy forward, see whole tensors; the next
        backward (or a ``state_dict``) shards them again. No-op otherwise."""
        if self._fsdp_root is not None:
            self._fsdp_root.unshard()

    def full_optimizer_state(self, optimizer) -> dict:
        """The optimizer's ``state_dict`` with every sharded (FSDP2) tensor gathered whole: the
        format of a one-process run (every process must call)."""
        state = optimizer.state_dict()
        if not self.fsdp2:
            return state
        from torch.distributed.tensor import DTensor

        full = {
            i: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in entry.items()}
            for i, entry in state["state"].items()
        }
        return {**state, "state": full}

    def load_full_optimizer_state(self, optimizer, state: dict) -> None:
        """Load a one-process-format optimizer ``state`` into the FSDP2-prepared ``optimizer``:
        each tensor sharded like its parameter (every process, the same ``state``)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        params = [p for group in optimizer.param_groups for p in group["params"]]
        sharded = {}
        for i, entry in state["state"].items():
            p = params[int(i)]
            sharded[i] = {
                k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.shape
                else v
                for k, v in entry.items()
            }
        optimizer.load_state_dict({**state, "state": sharded})

    def unwrap(self, model):
        return model if self.acc is None else self.acc.unwrap_model(model)

    def full_state_dict(self, model) -> dict | None:
        """The unwrapped model's full state dict (on the main process; ZeRO-3, FSDP2: every rank must call)."""
        if self.acc is None:
            return self.unwrap(model).state_dict()
        if self.fsdp2:  # accelerate's get_state_dict (1.16) hands back the DTensor shards here: gathered here
            from torch.distributed.tensor import DTensor

            state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
            return state if self.is_main else None
        return self.acc.get_state_dict(model)

    # -- DeepSpeed's sharded state (optimizer partitions, fp32 master weights) for --resume
    @property
    def zero_stage(self) -> int | None:
        """The ZeRO stage of a DeepSpeed launch; None without DeepSpeed."""
        return self.acc.state.deepspeed_plugin.zero_stage if self.deepspeed else None

    def engine_state_info(self) -> dict:
        """What a checkpoint's DeepSpeed state was written under; resuming needs the same."""
        return {"zero_stage": self.zero_stage, "processes": self.world}

    def save_engine_state(self, policy, folder: Path) -> None:
        """Every process writes its shard of the DeepSpeed state (``engine.save_checkpoint``:
        ZeRO optimizer partitions with the fp32 master weights, and the module states) into
        ``folder``, which every process sees. No-op without DeepSpeed."""
        if not self.deepspeed:
            return
        policy.save_checkpoint(str(folder), tag=ENGINE_STATE_TAG, client_state={}, save_latest=False)
        self.barrier()

    def load_engine_state(self, policy, folder: Path) -> None:
        """Restore what ``save_engine_state`` wrote into the prepared ``policy`` (every process)."""
        if not self.deepspeed:
            return
        path, _ = policy.load_checkpoint(
            str(folder),
            tag=ENGINE_STATE_TAG,
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if path is None:
            raise ArtifactError(f"{folder}: no DeepSpeed state (tag {ENGINE_STATE_TAG}) for this process")

    def check_engine_state(self, info: dict | None, path: Path) -> None:
        """Refuse (one line, before anything changes) to resume checkpoint ``path`` whose
        DeepSpeed state ``info`` (None: written without it) does not match this launch."""
        here = self.engine_state_info() if self.deepspeed else None
        if info == here:
            return
        if here is None:
            assert info is not None  # info != here
            raise MasktrlError(
                f"{path}: written under DeepSpeed ZeRO-{info['zero_stage']} with "
                f"{info['processes']} processes; "
                "resume it under the same accelerate launch"
            )
        if info is None:
            raise MasktrlError(
                f"{path}: has no DeepSpeed optimizer state (written without DeepSpeed, or before "
                "masktrl saved it); resume it "
                "the way it was trained, or start a new run from its weights (--set "
                "model.path=<checkpoint folder>)"
            )
        raise MasktrlError(
            f"{path}: DeepSpeed state of ZeRO-{info['zero_stage']} with {info['processes']} "
            "processes, this launch is "
            f"ZeRO-{here['zero_stage']} with {here['processes']}; resume with the same stage and "
            "process count"
        )

    def gathered(self, module):
        """Context in which ``module``'s ZeRO-3 partitioned parameters are whole (no-op otherwise)."""
        if not self.zero3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)

    # -- one optimizer update made of grad_accum micro-batches
    def accumulate(self, model):
        return contextlib.nullcontext() if self.acc is None else self.acc.accumulate(model)

    def backward(self, loss: torch.Tensor) -> None:
        if self.acc is None:
            loss.backward()
        else:  # accelerate (and DeepSpeed) divide by grad_accum; our loss is already normalised
            self.acc.backward(loss * self.acc.gradient_accumulation_steps)

    def clip_grad_norm(self, model, max_norm: float) -> float:
        if self.acc is None:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        norm = self.acc.clip_grad_norm_(model.parameters(), max_norm)  # DeepSpeed: clipped in its step
        return float("nan") if norm is None else float(norm)

    # -- collectives (no-ops for one process)
    def barrier(self) -> None:
        if self.world > 1:
            self.acc.wait_for_everyone()

    @contextlib.contextmanager
    def main_first(self):
        """The main process runs the block first (e.g. fills a cache), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    @contextlib.contextmanager
    def loading(self):
        """Loading the policy: the main process first (it may fill the warm-start cache), then
        the others. Under ZeRO-3 transformers' ``zero.Init`` is off meanwhile (it would need every
        process loading at once): each process loads the whole model, ``prepare`` shards it."""
        with self.main_first():
            if not self.zero3:
                yield
                return
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            try:
                yield
            finally:
                self.acc.state.deepspeed_plugin.set_deepspeed_weakref()  # ZeRO-3 aware again (generate syncs ranks)

    def gather_objects(self, obj) -> list:
        """``obj`` of every rank, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """The main process's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over ranks (float64)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return t.tolist()


ZERO_STAGES = ("0", "1", "2", "3")


def check_launch_settings() -> None:
    """The launch settings that can be checked before anything starts (the DeepSpeed JSON and
    ZeRO stage named by ``accelerate launch``); nothing to check for a plain run."""
    _check_deepspeed_json(os.environ.get(DS_CONFIG_ENV))
    _check_zero_stage(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"))
    _check_fsdp_settings()


def check_adamw(kernel: str, *, deepspeed: bool, fsdp: bool) -> None:
    """``train.adamw: fused`` runs under one process and DDP only: DeepSpeed and FSDP2 step the
    optimizer on their own (flattened, sharded) parameters, which the fused kernel is not tested
    with. ConfigError before anything starts (from the launch's settings, before DeepSpeed is
    imported)."""
    if kernel == "fused" and (deepspeed or fsdp):
        engine = "DeepSpeed" if deepspeed else "FSDP2"
        raise ConfigError(f"train.adamw=fused is not supported under {engine}: use train.adamw=foreach there")


def deepspeed_launch() -> bool:
    """Is this process started by a DeepSpeed launch (accelerate's settings, read before DeepSpeed is imported)?"""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"


def deepspeed_stage() -> int | None:
    """The ZeRO stage of a DeepSpeed launch, as ``check_launch_settings`` accepts it (accelerate's
    setting, read before DeepSpeed is imported); None for any other launch or a stage not named."""
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "").strip()
    return int(stage) if deepspeed_launch() and stage in ZERO_STAGES else None


def _fsdp_launch() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


# FSDP settings masktrl runs (environment variable as accelerate launch sets it, accepted values,
# the accelerate config key); anything else is refused before anything starts
FSDP_SETTINGS = (
    ("FSDP_VERSION", ("2",), "fsdp_version"),
    ("FSDP_AUTO_WRAP_POLICY", ("NO_WRAP",), "fsdp_auto_wrap_policy"),
    ("FSDP_OFFLOAD_PARAMS", ("false",), "fsdp_offload_params"),
    ("FSDP_CPU_RAM_EFFICIENT_LOADING", ("false",), "fsdp_cpu_ram_efficient_loading"),
    ("FSDP_ACTIVATION_CHECKPOINTING", ("false",), "fsdp_activation_checkpointing"),
)


def _check_fsdp_settings() -> None:
    """FSDP launches: only the tested FSDP2 settings (configs/accelerate/fsdp2.yaml)."""
    if not _fsdp_launch():
        return
    for env, accepted, key in FSDP_SETTINGS:
        value = os.environ.get(env, accepted[0]).strip().lower()
        if value not in [a.lower() for a in accepted]:
            raise ConfigError(
                f"accelerate launch settings ({env}={os.environ[env]}): {key} must be {accepted[0]} under "
                "masktrl (FSDP2 with the policy as one unit, as in configs/accelerate/fsdp2.yaml; "
                "train.gradient_checkpointing for activation checkpointing)"
            )


def _fsdp_on_cpu(acc) -> None:
    """Switch a MULTI_CPU (gloo) accelerate state to FSDP with the launch's plugin: accelerate
    (1.16, ``AcceleratorState.__init__``) sets FSDP only for accelerator devices and would
    otherwise run plain DDP on CPUs, silently."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if acc.state.distributed_type != DistributedType.MULTI_CPU:
        return
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    acc.state.distributed_type = DistributedType.FSDP


def _check_deepspeed_json(path: str | None) -> None:
    if not path or path == "none":
        return
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: DeepSpeed config file not found")
    try:
        data = read_json(p, error=ConfigError)  # bounded: depth, non-finite numbers
    except ConfigError as exc:
        raise ConfigError(f"{p}: invalid DeepSpeed config ({str(exc).split(': ', 1)[-1]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: invalid DeepSpeed config (top level must be an object)")
    stage = (
        data.get("zero_optimization", {}).get("stage", 0)
        if isinstance(data.get("zero_optimization", {}), dict)
        else None
    )
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{p}: invalid DeepSpeed config (zero_optimization.stage must be 0-3, got {stage!r})")


def _check_zero_stage(stage) -> None:
    if stage is None:
        return
    if str(stage).strip() not in ZERO_STAGES:
        raise ConfigError(f"{_launch_source()}: invalid DeepSpeed settings (ZeRO stage must be 0-3, got {stage!r})")


def _launch_source() -> str:
    ds = os.environ.get(DS_CONFIG_ENV)
    if ds and ds != "none":
        return ds
    keys = sorted(k for k in os.environ if k.startswith("ACCELERATE_"))
    return "accelerate launch settings (" + ", ".join(f"{k}={os.environ[k]}" for k in keys) + ")"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
