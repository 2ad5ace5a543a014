"""train.lr_schedule: warm-up then constant / linear / cosine; constant is the schedule masktrl always had."""

import copy
import math

import pytest
import torch

from masktrl.config import load_config
from masktrl.rl.schedule import lr_factor, make_scheduler


def _old_constant(warmup):  # the lambda make_optimizer used before schedules existed
    return lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0


@pytest.mark.parametrize("warmup", [0, 1, 3, 8])
def test_constant_is_the_old_schedule_exactly(warmup):
    new, old = lr_factor("constant", warmup, 100), _old_constant(warmup)
    assert [new(u) for u in range(40)] == [old(u) for u in range(40)]


def test_linear_and_cosine_warm_up_then_decay_to_the_floor():
    for name in ("linear", "cosine"):
        f = lr_factor(name, warmup=4, total=20, min_ratio=0.1)
        assert [f(u) for u in range(4)] == [0.25, 0.5, 0.75, 1.0]
        assert f(4) == 1.0  # decay starts after the warm-up
        values = [f(u) for u in range(4, 20)]
        assert all(a > b for a, b in zip(values, values[1:]))  # strictly decreasing
        assert f(20) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)  # floor, never below
    lin, cos = lr_factor("linear", 0, 10), lr_factor("cosine", 0, 10)
    assert lin(5) == pytest.approx(0.5) and cos(5) == pytest.approx(0.5)
    assert lin(2) == pytest.approx(0.8) and cos(2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))


def test_scheduler_counts_optimizer_updates_and_resumes_from_its_state():
    cfg = load_config(None, ["train.lr=1.0", "train.lr_schedule=linear", "train.warmup_steps=1", "train.minibatches=2"])
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=cfg.train.lr)
    sched = make_scheduler(opt, cfg.train, total_updates=10)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[3] == pytest.approx(
        1 - 1 / 8
    )  # warm-up: 1 step x 2 minibatches = 2 updates; decay over 8
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.lr)
    resumed = make_scheduler(opt2, cfg.train, total_updates=10)
    resumed.load_state_dict(sched.state_dict())
    assert resumed.get_last_lr() == sched.get_last_lr()
    sched.step(), resumed.step()
    assert resumed.get_last_lr() == sched.get_last_lr()


def test_adamw_on_cpu_runs_multi_tensor_and_gives_the_per_parameter_loops_bits():
    """make_optimizer's AdamW on CPU tensors uses torch's multi-tensor kernels (foreach=True);
    they make the same updates, bit for bit, as the per-parameter loop torch uses on a CPU by
    default, with weight decay and a learning rate that changes from update to update."""
    from masktrl.rl.schedule import adamw_foreach

    torch.manual_seed(0)
    shapes = [(50, 16), (16, 16), (8, 16), (16,), (3,)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(6)]

    def run(foreach):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), foreach=foreach)
        for u, gs in enumerate(grads):
            opt.param_groups[0]["lr"] = 1e-2 * (u + 1) / 6
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        return params, opt.state_dict()

    params = [torch.nn.Parameter(t.clone()) for t in start]
    assert adamw_foreach(params) is True
    assert adamw_foreach([]) is None
    (loop, loop_state), (multi, multi_state) = run(False), run(adamw_foreach(params))
    assert all(torch.equal(a, b) for a, b in zip(loop, multi))
    for i in loop_state["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loop_state["state"][i][key], multi_state["state"][i][key])


def test_make_optimizer_passes_foreach_for_a_cpu_model():
    """The RL optimizer of a CPU model is built with foreach=True, the kernels the test above
    shows exact."""
    from masktrl.rl.update import make_optimizer

    cfg = load_config(None)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer, _ = make_optimizer(model, cfg.train)
    assert optimizer.param_groups[0]["foreach"] is True


def test_fused_adamw_makes_the_foreach_update_up_to_float32_rounding():
    """train.adamw=fused (torch's fused kernel) against the foreach kernels the default runs: the
    parameters and both moments agree to float32 rounding after every update, with weight decay
    and a learning rate that changes from update to update; they need not agree bit for bit (the
    kernel computes the update in another order), which is why fused is another run."""
    from masktrl.rl.schedule import adamw_kernels

    torch.manual_seed(0)
    shapes = [(50, 16), (16, 16), (8, 16), (16,), (3,)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(8)]
    params = {k: [torch.nn.Parameter(t.clone()) for t in start] for k in ("foreach", "fused")}
    opts = {
        k: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), **adamw_kernels(ps, k))
        for k, ps in params.items()
    }
    assert opts["fused"].param_groups[0]["fused"] is True and opts["foreach"].param_groups[0]["foreach"] is True
    for u, gs in enumerate(grads):
        for k, opt in opts.items():
            opt.param_groups[0]["lr"] = 1e-2 * (u + 1) / 8
            for p, g in zip(params[k], gs):
                p.grad = g.clone()
            opt.step()
        for a, b in zip(params["foreach"], params["fused"]):
            torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-6)
        for i, p in enumerate(params["foreach"]):
            ref, fus = opts["foreach"].state[p], opts["fused"].state[params["fused"][i]]
            torch.testing.assert_close(fus["exp_avg"], ref["exp_avg"], rtol=2e-6, atol=1e-7)
            torch.testing.assert_close(fus["exp_avg_sq"], ref["exp_avg_sq"], rtol=2e-6, atol=1e-9)
            assert float(fus["step"]) == float(ref["step"]) == u + 1
    # each update moves a parameter by about lr (Adam's normalised step), far above the tolerance
    assert min((a - s).abs().max().item() for a, s in zip(params["fused"], start)) > 1e-3


def test_make_optimizer_uses_the_fused_kernel_when_asked():
    from masktrl.rl.update import make_optimizer

    cfg = load_config(None, ["train.adamw=fused"])
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer, _ = make_optimizer(model, cfg.train)
    assert optimizer.param_groups[0]["fused"] is True


def test_fused_adamw_optimizer_state_round_trips_like_a_resume():
    """A resumed run rebuilds the optimizer from its config and loads the checkpoint's state: with
    train.adamw=fused the resumed optimizer continues bit for bit as the uninterrupted one."""
    from masktrl.rl.update import make_optimizer

    cfg = load_config(None, ["train.adamw=fused", "train.weight_decay=0.1"])
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(6)]

    def steps(m, opt, sched, gs):
        for g in gs:
            for p, x in zip(m.parameters(), g):
                p.grad = x.clone()
            opt.step()
            sched.step()

    opt, sched = make_optimizer(model, cfg.train)
    steps(model, opt, sched, grads[:3])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))  # as written to disk
    steps(model, opt, sched, grads[3:])

    resumed = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    resumed.load_state_dict(saved[0])
    opt2, sched2 = make_optimizer(resumed, cfg.train)
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    assert opt2.param_groups[0]["fused"] is True
    steps(resumed, opt2, sched2, grads[3:])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


def test_fused_adamw_is_refused_under_deepspeed_and_fsdp2():
    from masktrl.errors import ConfigError
    from masktrl.rl.distributed import check_adamw

    check_adamw("fused", deepspeed=False, fsdp=False)  # one process or DDP
    check_adamw("foreach", deepspeed=True, fsdp=False)
    check_adamw("foreach", deepspeed=False, fsdp=True)
    with pytest.raises(ConfigError, match="train.adamw=fused is not supported under DeepSpeed"):
        check_adamw("fused", deepspeed=True, fsdp=False)
    with pytest.raises(ConfigError, match="train.adamw=fused is not supported under FSDP2"):
        check_adamw("fused", deepspeed=False, fsdp=True)
