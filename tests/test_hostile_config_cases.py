"""Bad input a hostile tester found past the checks in what a user writes rather than types as a
flag: a rule file's kernel, ``--set`` values and what the verl adapter is handed. Each is one
line (a ``ConfigError``) naming what is wrong, never a traceback from inside the update nor a run
that silently differs."""

import re

import pytest
import torch

from masktrl.config import load_config, resolve_method_spec, split_method
from masktrl.errors import ConfigError
from masktrl.methods import TokenBatch
from tests.conftest import cli

RULE = """from dataclasses import dataclass
import torch
from masktrl.methods import MethodParams, TokenLosses, register_method, unit_ratio_log


@dataclass(frozen=True)
class P(MethodParams):
    scale: float = 1.0


@register_method("mine", P)
def mine(batch, adv, p, u):
    loss = -adv * unit_ratio_log(batch).exp()
    return {returns}
"""


def _batch(n: int = 5) -> TokenBatch:
    return TokenBatch(
        logp=torch.full((n,), -1.0, dtype=torch.float64).requires_grad_(),
        behavior_logp=torch.full((n,), -1.2, dtype=torch.float64),
        sampled_ids=torch.arange(n),
        topk_ids=torch.zeros(n, 2, dtype=torch.long),
        topk_behavior_logp=torch.full((n, 2), -2.0, dtype=torch.float64),
        topk_logp=torch.full((n, 2), -2.0, dtype=torch.float64),
        seq_ids=torch.zeros(n, dtype=torch.long),
    )


@pytest.mark.parametrize(
    "returns, says",
    [
        # each was a traceback of about 70 lines and exit code 1 from inside the update
        ('(_ for _ in ()).throw(RuntimeError("boom"))', "its kernel raised RuntimeError: boom"),
        ("TokenLosses(torch.zeros(3), ~batch.valid, None, None, None, None)", "a loss that is a torch.float32 tensor"),
        ("None", "its kernel returned NoneType, not TokenLosses"),
        ("TokenLosses(loss, torch.zeros(batch.n), None, None, None, None)", "a mask that is a torch.float32 tensor"),
        # an integer loss had no gradient: check-method passed it, train failed in backward
        ("TokenLosses(loss.long(), ~batch.valid, None, None, None, None)", "a loss that is a torch.int64 tensor"),
        # a detached loss passed check-method (as a zero gradient) and failed in backward, a traceback
        ("TokenLosses(loss.detach(), ~batch.valid, None, None, None, None)", "a loss with no gradient through log pi"),
    ],
)  # fmt: skip
def test_a_rule_files_kernel_that_breaks_its_contract_is_one_line(tmp_path, returns, says):
    path = tmp_path / "rules.py"
    path.write_text(RULE.format(returns=returns))
    bound = resolve_method_spec(f"{path}:mine")
    with pytest.raises(ConfigError, match=f"method '{path}:mine': its kernel") as exc:
        bound.token_losses(_batch(), torch.ones(5, dtype=torch.float64))
    assert says in str(exc.value) and f"masktrl check-method {path}:mine" in str(exc.value)


def test_a_rule_files_kernel_that_keeps_its_contract_is_unchanged(tmp_path):
    path = tmp_path / "rules.py"
    path.write_text(RULE.format(returns="TokenLosses(loss, ~batch.valid, None, None, None, None)"))
    out = resolve_method_spec(f"{path}:mine").token_losses(_batch(), torch.ones(5, dtype=torch.float64))
    assert out.loss.requires_grad and out.loss.shape == (5,) and out.mask.dtype == torch.bool


CORRECTION = """from masktrl.methods import register_correction


@register_correction("mine", keys={{}})
def mine(log_rho, valid, seq_ids, adv, keys):
    return {returns}
"""


@pytest.mark.parametrize(
    "returns, says",
    [
        ('(_ for _ in ()).throw(RuntimeError("boom"))', "its function mine raised RuntimeError: boom"),
        ("log_rho.exp()[:2], valid[:2]", "got ['torch.float64 [2]', 'torch.bool [2]']"),
        ("log_rho.exp()", "must return (f, keep), each a tensor of shape [N] = [6]"),
    ],
)
def test_a_correction_files_function_that_breaks_its_contract_is_one_line(tmp_path, returns, says):
    """As a kernel's: a traceback from inside the update, exit code 1."""
    from masktrl.methods import correction_weights

    path = tmp_path / "corr.py"
    path.write_text(CORRECTION.format(returns=returns))
    correction = resolve_method_spec("grpo", {"kind": f"{path}:mine"}).correction
    mu = torch.full((6,), -1.0, dtype=torch.float64)
    with pytest.raises(ConfigError, match=f"method.correction.kind '{path}:mine': its function mine") as exc:
        correction_weights(correction, mu, mu + 0.1, torch.arange(6) // 3, torch.ones(6, dtype=torch.float64))
    assert says in str(exc.value)


@pytest.mark.parametrize(
    "sets, says",
    [
        # was accepted: torch's chunk gave 4 minibatches of one sequence, 4 updates for the 5 asked
        (["train.minibatches=5"], "train.minibatches=5 x train.grad_accum=1 needs at least 5 sequences a step"),
        # was accepted: the run folder was made and the run failed at its first update
        (["train.grad_accum=5"], "train.minibatches=1 x train.grad_accum=5 needs at least 5"),
        (["train.minibatches=2", "train.grad_accum=3"], "train.minibatches=2 x train.grad_accum=3 needs at least 6"),
    ],
)
def test_more_minibatches_or_micro_batches_than_sequences_are_refused(sets, says):
    small = ["rollout.prompts_per_step=2", "rollout.n=2"]
    with pytest.raises(ConfigError, match="but a step has rollout.prompts_per_step x rollout.n = 4") as exc:
        load_config(None, [*small, *sets])
    assert says in str(exc.value)
    load_config(None, [*small, "train.minibatches=2", "train.grad_accum=2"])  # 4 sequences: one a micro-batch


def test_keep_steps_take_the_comma_form_every_list_key_takes():
    """``train.keep_steps=50,100`` said "must be an integer, got '50'" (train.report_to=a,b works)."""
    assert load_config(None, ["train.keep_steps=50,100"]).train.keep_steps == (50, 100)
    with pytest.raises(ConfigError, match="train.keep_steps must be an integer, got 'x'"):
        load_config(None, ["train.keep_steps=50,x"])


@pytest.mark.parametrize(
    "value, says",
    [
        # accepted, and the file never read: the run's own task is evaluated on its own problems
        ("eval.data={synthetic: s.jsonl}", "eval.data must be one of aime24, aime25, aime, math500, gsm8k; got 'synth"),
        # accepted: the benchmark evaluated twice at every evaluation, into the same metrics
        ("train.eval_benchmarks=synthetic,synthetic", "train.eval_benchmarks lists a benchmark twice"),
    ],
)  # fmt: skip
def test_evaluation_keys_that_would_be_ignored_or_repeated_are_refused(value, says):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [value])
    assert says in str(exc.value)


def test_probabilities_that_overflow_name_the_temperature_too():
    """``--set rollout.temperature=1e-300`` stopped the run with "its weights have diverged": the
    weights were fine, logits / T overflowed."""
    from masktrl.errors import MasktrlError
    from masktrl.rollout.draw import inverse_cdf
    from masktrl.rollout.hf import finite_probabilities

    says = "its weights have diverged, or a sampling temperature near 0 made logits / T overflow"
    with pytest.raises(MasktrlError, match=says):
        with finite_probabilities():
            torch.multinomial(torch.tensor([[float("nan"), 1.0]]), 1)
    with pytest.raises(MasktrlError, match=says):
        inverse_cdf(torch.tensor([[float("nan"), 0.0]]))


@pytest.mark.parametrize("info", [{"batch_num_tokens": -6}, {"batch_num_tokens": 0}, {"dp_size": -1}])
def test_the_verl_loss_refuses_a_global_batch_info_that_is_not_positive(info):
    """batch_num_tokens -6 (or dp_size -1) flipped the loss's sign, gradient ascent without a word;
    0 raised ZeroDivisionError."""
    from masktrl.integrations.verl import policy_loss

    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    args = (old, (old + 0.1).requires_grad_(), torch.tensor([1.0, 0.5], dtype=torch.float64), torch.ones(2, 3))
    fn = policy_loss("grpo")
    fine, _ = fn(*args, "token-mean", {"global_batch_info": {"batch_num_tokens": 6}})
    assert fine.item() < 0  # -A r averaged over the tokens, A > 0: the sign the update needs
    key = next(iter(info))
    with pytest.raises(ConfigError, match=f"config.global_batch_info's {key} must be a number > 0"):
        fn(*args, "token-mean", {"global_batch_info": {"batch_num_tokens": 6, **info}})


def test_a_rule_file_that_is_a_folder_is_named_a_folder(tmp_path):
    """A folder ``rules.py`` was "no such file rules.py", while ``ls`` shows it there."""
    (tmp_path / "rules.py").mkdir()
    with pytest.raises(ConfigError, match=f"{tmp_path / 'rules.py'} is a folder; give the Python file"):
        resolve_method_spec(f"{tmp_path / 'rules.py'}:mine")
    with pytest.raises(ConfigError, match="rules.py is a folder"):
        resolve_method_spec("grpo", {"kind": f"{tmp_path / 'rules.py'}:mine"})


def test_a_method_spec_that_gives_a_parameter_twice_is_refused():
    """``--methods grpo:eps_low=0.1:eps_low=0.2`` trained eps_low 0.2 in a run named
    grpo-eps_low-0.1-eps_low-0.2-seed0."""
    with pytest.raises(ConfigError, match="'grpo:eps_low=0.1:eps_low=0.2' gives eps_low twice"):
        split_method("grpo:eps_low=0.1:eps_low=0.2")
    assert split_method("grpo:eps_low=0.1:eps_high=0.2")[1] == ["method.eps_low=0.1", "method.eps_high=0.2"]


def test_loading_a_rule_file_writes_no_pycache_beside_it(tmp_path, monkeypatch):
    """Python wrote __pycache__/rules.cpython-*.pyc next to the user's file (outside --out; and
    check-method "writes nothing") unless PYTHONDONTWRITEBYTECODE was set."""
    import sys

    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    path = tmp_path / "rules.py"
    path.write_text(RULE.format(returns="TokenLosses(loss, ~batch.valid, None, None, None, None)"))
    resolve_method_spec(f"{path}:mine")
    assert [p.name for p in tmp_path.iterdir()] == ["rules.py"] and sys.dont_write_bytecode is False


def test_a_reward_or_env_file_writes_no_pycache_beside_it(tmp_path, monkeypatch):
    """The same for task.reward (loaded in its worker processes) and task.env files."""
    import sys

    from masktrl.tasks import make_reward
    from masktrl.tasks.envs import load_env

    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)  # the reward workers' own setting
    (tmp_path / "rw.py").write_text("def score(prompts, completions, answers):\n    return [1.0 for _ in prompts]\n")
    (tmp_path / "envs.py").write_text("class Echo:\n    def reset(self, example): ...\n    def step(self, call): ...\n")
    reward = make_reward(f"{tmp_path / 'rw.py'}:score", workers=1)
    try:
        assert reward.score(["p"], ["4"], ["4"], [{}]) == [1.0]
    finally:
        reward.close()
    assert load_env(f"{tmp_path / 'envs.py'}:Echo").__name__ == "Echo"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["envs.py", "rw.py"] and sys.dont_write_bytecode is False


@pytest.mark.parametrize("method", ["nosuch", ""])
def test_config_keys_of_an_unknown_method_is_one_line(cli_error, method):
    """``masktrl config keys --method nosuch`` was a 48-line traceback (ValueError) and exit 1;
    ``--method ''`` listed grpo's keys as if no method were given."""
    line = cli_error("config", "keys", "--method", method)
    assert f"unknown method {method!r}; valid methods: " in line


def test_check_method_fails_a_rule_whose_loss_has_no_gradient(tmp_path):
    """A kernel returning ``loss.detach()`` conformed: its gradient counted as zero, and its value
    (0 for unit_ratio_log) matched; ``train`` then failed in backward with a traceback."""
    from masktrl.analysis.conformance import check_method, passed

    path = tmp_path / "rules.py"
    path.write_text(RULE.format(returns="TokenLosses(loss.detach() * 0, ~batch.valid, None, None, None, None)"))
    bound = resolve_method_spec(f"{path}:mine")
    rows = check_method(bound.method, bound.params, spec=f"{path}:mine")
    first = rows[0]
    assert not passed(rows) and first.name == "gradient = value" and first.ok is False
    assert "no gradient through log pi" in first.detail


@pytest.mark.parametrize(
    "value, says",
    [
        (".nan", "method.scale must be a number, got nan"),
        ("abc", "method.scale must be a number, got 'abc'"),
        ("true", "method.scale must be a number, got True"),
        ("[1]", "method.scale must be a number, got [1]"),
    ],
)
def test_a_rule_files_parameters_have_the_kind_of_their_defaults(tmp_path, value, says):
    """``--set method.scale=.nan`` (or ``=abc``) on a rule from a file whose params class checks
    nothing was accepted and trained with NaN (or text) as the parameter."""
    path = tmp_path / "rules.py"
    path.write_text(RULE.format(returns="TokenLosses(loss, ~batch.valid, None, None, None, None)"))
    with pytest.raises(ConfigError, match=f"^{re.escape(says)}$"):
        load_config(None, [f"method.scale={value}"], method=f"{path}:mine")
    assert load_config(None, ["method.scale=2"], method=f"{path}:mine").method.params.scale == 2


@pytest.mark.parametrize("name", ["", "a:b", "a,b", " a", ".a", "a b"])
def test_a_rule_or_correction_name_that_cannot_be_written_is_refused(tmp_path, name):
    """``register_method("a:b", ...)`` was accepted (``rules.py:a:b`` then read ``b`` as a parameter,
    and rich printed ``:b:`` as an emoji); ``""`` too, a rule no spec can name."""
    path = tmp_path / "rules.py"
    path.write_text(RULE.format(returns="None").replace('register_method("mine"', f"register_method({name!r}"))
    with pytest.raises(ConfigError, match=f"raised ValueError on import: method name {re.escape(repr(name))}: use"):
        resolve_method_spec(f"{path}:mine")
    text = f"from masktrl.methods import register_correction\n@register_correction({name!r})\ndef f(*a):\n    pass\n"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"correction name {re.escape(repr(name))}: use"):
        resolve_method_spec("grpo", {"kind": f"{path}:f"})


def _verl_args(b: int = 2, t: int = 3):
    old = torch.full((b, t), -1.0, dtype=torch.float64)
    return old, (old + 0.1).requires_grad_(), torch.tensor([1.0, 0.5], dtype=torch.float64)[:b], torch.ones(b, t)


@pytest.mark.parametrize(
    "index, value, says",
    [
        (0, torch.full((2, 4), -1.0), "old_log_prob must have response_mask's shape [2, 3], got [2, 4]"),
        (1, torch.full((3, 3), -1.0), "log_prob must have response_mask's shape [2, 3], got [3, 3]"),
        (2, torch.ones(3), "advantages must be [2, 3] (per token) or [2] (per sequence), got [3]"),
        (3, torch.ones(6), "response_mask must be [B, T] (the response tokens), got [6]"),
        (2, [1.0, 0.5], "advantages must be a torch.Tensor, got list"),
        (0, torch.full((2, 3), 0.4), "old_log_prob holds 0.4 on a response token: log-probabilities are <= 0"),
        (1, torch.full((2, 3), 2.5), "log_prob holds 2.5 on a response token"),
    ],
)
def test_the_verl_loss_refuses_tensors_that_do_not_fit(index, value, says):
    """Mismatched shapes were a raw IndexError or RuntimeError from inside the loss; probabilities
    (or logits) handed over as log-probabilities trained without a word."""
    from masktrl.integrations.verl import policy_loss

    args = list(_verl_args())
    fn = policy_loss("grpo")
    assert torch.isfinite(fn(*args)[0])
    args[index] = value
    with pytest.raises(ConfigError, match=re.escape(says)):
        fn(*args)


def test_the_verl_loss_reads_rounding_above_zero_and_padding_as_given():
    """A log-prob a hair above 0 (bf16 rounding) on a response token, and anything on padding, is taken."""
    from masktrl.integrations.verl import LOGP_SLACK, policy_loss

    old, new, adv, mask = _verl_args()
    mask[1, 2] = 0
    old = old.clone()
    old[0, 0], old[1, 2] = LOGP_SLACK / 2, 7.0
    assert torch.isfinite(policy_loss("grpo")(old, new, adv, mask)[0])


def test_the_verl_loss_refuses_topk_lists_of_another_shape():
    from masktrl.integrations.verl import policy_loss

    old, new, adv, mask = _verl_args()
    ids = torch.zeros(2, 3, 4, dtype=torch.long)
    lp = torch.full((2, 3, 4), -2.0, dtype=torch.float64)
    kw = dict(responses=torch.zeros(2, 3, dtype=torch.long), rollout_topk_ids=ids, rollout_topk_log_probs=lp)
    fn = policy_loss("pdm")
    assert torch.isfinite(fn(old, new, adv, mask, **kw, topk_log_prob=lp)[0])
    with pytest.raises(
        ConfigError, match=re.escape("topk_log_prob must be [2, 3, K] with rollout_topk_ids' K = 4, got [2, 3, 3]")
    ):
        fn(old, new, adv, mask, **kw, topk_log_prob=lp[..., :3])


def test_a_command_stopped_by_ctrl_c_says_so(tmp_path):
    """Ctrl-C in any command but train (here a rule file raising KeyboardInterrupt on import, as a
    Ctrl-C during its import does) exited 130 without a word: typer turned it into a silent exit."""
    from tests.conftest import masktrl

    (tmp_path / "rules.py").write_text("raise KeyboardInterrupt\n")
    r = masktrl("check-method", "rules.py:mine", cwd=tmp_path)
    assert r.returncode == 130 and r.stderr.strip() == "interrupted", (r.returncode, r.stderr)
    assert r.stdout == "" and "Traceback" not in r.stderr


ENV = """class E:
    stop = {stop}

    def reset(self, example):
        pass

    def step(self, call):
        return "ok", False
"""


@pytest.mark.parametrize(
    "stop, says",
    [
        ("5", "the class's stop attribute must be a non-empty string (the text that ends a tool call), got 5"),
        ('""', "the class's stop attribute must be a non-empty string (the text that ends a tool call), got ''"),
        ("None", "set task.call_stop (the text that ends a tool call); the class has no stop attribute"),
    ],
)
def test_an_environment_without_a_usable_stop_string_is_refused_before_the_run(tmp_path, cli_error, stop, says):
    """``--dry-run`` passed an environment whose ``stop`` was 5; the run then made its folder and
    failed at its first rollout, saying the class had no stop attribute."""
    (tmp_path / "envs.py").write_text(ENV.format(stop=stop))
    env, out = f"{tmp_path / 'envs.py'}:E", tmp_path / "out"
    for dry in (["--dry-run"], []):
        line = cli_error("train", "--config", "agentic", "--set", f"task.env={env}", "--out", out, *dry)
        assert line == f"error: task.env {env!r}: {says}" + ("; fix it or set task.call_stop" if stop != "None" else "")
        assert not out.exists()
    dry_run = ["train", "--config", "agentic", "--set", f"task.env={env}", "--set", "task.call_stop=</x>"]
    assert cli(*dry_run, "--out", out, "--dry-run").exit_code == 0


@pytest.mark.parametrize("key", ["task.reward_timeout_s", "task.env_timeout_s"])
def test_a_timeout_beyond_what_a_wait_can_take_is_refused(key):
    """``task.env_timeout_s=1e300`` passed the config and the run died at its first tool call
    with a traceback (OverflowError from the thread's join); a reward's pipe poll overflows past
    24.8 days."""
    sets = ["task.env=masktrl.tasks.tools:Calculator"] if key == "task.env_timeout_s" else []
    with pytest.raises(ConfigError, match=f"^{key} must be at most 1e\\+06 s \\(about 11.6 days\\), got 1e\\+300$"):
        load_config(None, [*sets, f"{key}=1e300"])
    assert getattr(load_config(None, [*sets, f"{key}=1e6"]).task, key.split(".")[1]) == 1e6


@pytest.mark.parametrize(
    "assignment, says",
    [
        # the union int | dict let None through: check_staleness compared None >= 0 (a TypeError)
        ("rollout.staleness=null", "rollout.staleness must be an integer, got None"),
        # apply_chat_template raised transformers' ValueError from the prompt-length check
        ("model.chat_template=true", "model.chat_template is true, but this tokenizer has no chat template"),
    ],
)
def test_a_config_value_that_raised_inside_the_dry_run_is_one_line(tmp_path, cli_error, assignment, says):
    """Found by trying 13 odd values (-1, 0, 1e300, NaN, -inf, text, '', 1.5, true, [], {}, null,
    1e14) on every key of five shipped configs with ``train --dry-run``: these two were tracebacks."""
    line = cli_error(
        "train", "--config", "configs/tiny.yaml", "--dry-run", "--out", tmp_path / "out", "--set", assignment
    )
    assert says in line and not (tmp_path / "out").exists()
