"""Plain float64 reference implementations (loops over lists, full-vocab autograd) and a random
case generator shared by the ``test_methods_*`` files.

Nothing here calls ``masktrl.methods`` except to build the ``TokenBatch`` under test, so
the references are independent of the vectorised code they check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from masktrl.methods import TokenBatch

NEG_INF = float("-inf")
F64 = torch.float64


# --------------------------------------------------------------------------- random cases


@dataclass
class Row:
    """One token: full-vocab logits, the sampled token and the recorded list (with junk)."""

    z_mu: torch.Tensor  # [V] behaviour logits (may hold -inf)
    z: torch.Tensor  # [V] training logits (finite)
    k: int
    ids: list[int]  # recorded list incl. padding (-1) and duplicates
    mu_list: list[float]  # log mu at ids (junk at padding / duplicates)
    pi_list: list[float]
    top: list[int] = field(default_factory=list)  # the genuine top list in order

    @property
    def mu_lp(self) -> torch.Tensor:
        return torch.log_softmax(self.z_mu, -1)

    @property
    def pi_lp(self) -> torch.Tensor:
        return torch.log_softmax(self.z, -1)


def make_row(
    gen: torch.Generator,
    v: int,
    k_list: int,
    *,
    outside=False,
    zero_mass=False,
    peaked=False,
    padding=False,
    duplicates=False,
    scale=1.5,
    noise=0.7,
) -> Row:
    z = torch.randn(v, generator=gen, dtype=F64) * scale
    z_mu = z + noise * torch.randn(v, generator=gen, dtype=F64)
    if zero_mass:
        n0 = int(torch.randint(1, max(2, v // 2), (1,), generator=gen))
        idx = torch.randperm(v, generator=gen)[:n0]
        z_mu[idx] = NEG_INF
    mu = torch.softmax(z_mu, -1)
    order = sorted(range(v), key=lambda i: (-float(mu[i]), i))
    top = order[: min(k_list, v)]
    if peaked:
        z_mu[top] += 60.0
        mu = torch.softmax(z_mu, -1)
    k = int(torch.multinomial(mu, 1, generator=gen))
    unseen = [i for i in range(v) if i not in top and mu[i] > 0]
    if outside and unseen:
        k = unseen[int(torch.randint(0, len(unseen), (1,), generator=gen))]
    mu_lp, pi_lp = torch.log_softmax(z_mu, -1), torch.log_softmax(z, -1)
    ids = list(top)
    mu_list = [float(mu_lp[i]) for i in ids]
    pi_list = [float(pi_lp[i]) for i in ids]
    if duplicates and ids:
        for _ in range(2):
            j = int(torch.randint(0, len(ids), (1,), generator=gen))
            pos = int(torch.randint(j + 1, len(ids) + 1, (1,), generator=gen))
            ids.insert(pos, ids[j])
            mu_list.insert(pos, -0.3)  # junk: only the first occurrence counts
            pi_list.insert(pos, -5.0)
    if padding:
        for _ in range(2):
            pos = int(torch.randint(0, len(ids) + 1, (1,), generator=gen))
            ids.insert(pos, -1)
            mu_list.insert(pos, float("nan"))  # padding values are ignored, whatever they are
            pi_list.insert(pos, 0.5)
    return Row(z_mu, z, k, ids, mu_list, pi_list, top)


def make_batch(rows: list[Row], vocab_size: int | None, seq_ids=None, logp_requires_grad=False) -> TokenBatch:
    width = max(len(r.ids) for r in rows)
    n = len(rows)
    ids = torch.full((n, width), -1, dtype=torch.long)
    mu = torch.full((n, width), NEG_INF, dtype=F64)
    pi = torch.full((n, width), NEG_INF, dtype=F64)
    for i, r in enumerate(rows):
        ids[i, : len(r.ids)] = torch.tensor(r.ids, dtype=torch.long)
        mu[i, : len(r.ids)] = torch.tensor(r.mu_list, dtype=F64)
        pi[i, : len(r.ids)] = torch.tensor(r.pi_list, dtype=F64)
    logp = torch.stack([r.pi_lp[r.k] for r in rows]).detach()
    blp = torch.stack([r.mu_lp[r.k] for r in rows]).detach()
    if logp_requires_grad:
        logp.requires_grad_(True)
    seq = torch.zeros(n, dtype=torch.long) if seq_ids is None else torch.as_tensor(seq_ids, dtype=torch.long)
    return TokenBatch(logp, blp, torch.tensor([r.k for r in rows]), ids, mu, pi, seq, vocab_size)


def batch_from_logits(rows: list[Row], z: torch.Tensor, vocab_size: int | None, seq_ids) -> TokenBatch:
    """Like ``make_batch`` but log pi (sampled and listed) is gathered from log_softmax(z) [N, V],
    so gradients reach the logits ``z`` (listed entries too: the methods must stop them)."""
    ref = make_batch(rows, vocab_size, seq_ids)
    lp = torch.log_softmax(z, -1)  # [N, V]
    logp = lp.gather(1, ref.sampled_ids[:, None]).squeeze(1)
    topk = torch.where(ref.topk_ids >= 0, lp.gather(1, ref.topk_ids.clamp_min(0)), ref.topk_logp)
    return TokenBatch(
        logp, ref.behavior_logp, ref.sampled_ids, ref.topk_ids, ref.topk_behavior_logp, topk, ref.seq_ids, vocab_size
    )


def random_rows(seed: int, n: int, v: int, k_list: int, **flags) -> list[Row]:
    """n rows; flags given as True are applied to every row, otherwise each edge case with prob 1/3."""
    gen = torch.Generator().manual_seed(seed)
    names = ("outside", "zero_mass", "peaked", "padding", "duplicates")
    rows = []
    for _ in range(n):
        kw = {name: flags.get(name) if name in flags else bool(torch.rand(1, generator=gen) < 1 / 3) for name in names}
        rows.append(make_row(gen, v, k_list, **kw))
    return rows


# --------------------------------------------------------------------------- references: support


def ref_genuine(r: Row) -> list[tuple[int, float, float]]:
    """The deduplicated, unpadded list; the entry at k takes (log mu_k, log pi_k)."""
    seen, out = set(), []
    for i, a, b in zip(r.ids, r.mu_list, r.pi_list):
        if i < 0 or i in seen:
            continue
        seen.add(i)
        if i == r.k:
            a, b = float(r.mu_lp[r.k]), float(r.pi_lp[r.k])
        out.append((i, a, b))
    return out


def ref_support(r: Row, rule: str = "union", k_slots: int | None = None) -> list[tuple[int, float, float]]:
    g = ref_genuine(r)
    if any(i == r.k for i, _, _ in g):
        return g
    if rule == "replace_last":
        g = g[: (k_slots or len(r.ids)) - 1]
    return g + [(r.k, float(r.mu_lp[r.k]), float(r.pi_lp[r.k]))]


def ref_tails(atoms, v: int | None) -> tuple[float, float, int | None]:
    mu_t = max(0.0, 1.0 - math.fsum(math.exp(a) for _, a, _ in atoms))
    pi_t = max(0.0, 1.0 - math.fsum(math.exp(b) for _, _, b in atoms))
    m = None if v is None else v - len(atoms)
    if m == 0:
        mu_t = pi_t = 0.0
    return mu_t, pi_t, m


def ref_bracket(r: Row, v: int | None) -> tuple[float, float]:
    """The certified bracket [lo, hi] of Ddot_KL, written from its definition on the union support."""
    atoms = ref_support(r)
    mu_t, pi_t, m = ref_tails(atoms, v)
    k_idx = [a for a, _, _ in atoms].index(r.k)
    mu = [math.exp(a) for _, a, _ in atoms]
    pi = [math.exp(b) for _, _, b in atoms]
    base = (pi[k_idx] - mu[k_idx]) - sum(p * (p - q) for p, q in zip(pi, mu))
    listed = [math.exp(a) for _, a, _ in ref_genuine(r)]
    mu_cap = min(listed) if listed else math.inf
    quad = 0.0 if m is None or m == 0 else pi_t * pi_t / m
    return base - pi_t * pi_t, base - quad + pi_t * min(mu_cap, mu_t)


# --------------------------------------------------------------------------- references: formulas


def kl_plain(mu: list[float], pi: list[float], floor_last: bool = False) -> float:
    """sum mu_i log(mu_i/pi_i) over mu_i > 0 (inf if pi_i = 0); optional 1e-12 floor on the last pi."""
    tot = 0.0
    for j, (a, b) in enumerate(zip(mu, pi)):
        if a <= 0:
            continue
        if floor_last and j == len(mu) - 1:
            b = max(b, 1e-12)
        if b <= 0:
            return math.inf
        tot += a * (math.log(a) - math.log(b))
    return tot


def tv_plain(mu: list[float], pi: list[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(mu, pi))


def ddot_kl_plain(mu: list[float], pi: list[float], k: int, mult: list[float] | None = None) -> float:
    """§4.1 / §4.2 closed form: (pi_k - mu_k) - sum_a pi_a (pi_a - mu_a) / n_a."""
    mult = mult or [1.0] * len(mu)
    return (pi[k] - mu[k]) - sum(p * (p - m) / n for p, m, n in zip(pi, mu, mult))


def ddot_tv_plain(mu: list[float], pi: list[float], k: int, mult: list[float] | None = None) -> float:
    """§4.2 closed form with multiplicities; an atom of multiplicity n has v = -pi/n (not k)."""
    mult = mult or [1.0] * len(mu)
    vbar = pi[k] - sum(p * p / n for p, n in zip(pi, mult))
    tot = 0.0
    for j, (p, m, n) in enumerate(zip(pi, mu, mult)):
        s = (m > p) - (m < p)
        v = (1.0 if j == k else 0.0) - p / n
        tot += s * p * (v - vbar)
    return -0.5 * tot


def full_div(mu_lp: torch.Tensor, z: torch.Tensor, kind: str) -> torch.Tensor:
    """D(mu || softmax(z)) on the full vocabulary, differentiable in z."""
    lp = torch.log_softmax(z, -1)
    pos = mu_lp > NEG_INF
    if kind == "kl":
        mu = mu_lp.exp()
        return (torch.where(pos, mu * (mu_lp - lp), torch.zeros_like(lp))).sum()
    return 0.5 * (mu_lp.exp() - lp.exp()).abs().sum()


def autograd_ddot(
    mu_lp: torch.Tensor, z: torch.Tensor, k: int, kind: str, direction: torch.Tensor | None = None
) -> float:
    """grad_z D(mu||softmax(z)) . v with v = e_k - pi (or ``direction``), via autograd."""
    z = z.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(full_div(mu_lp, z, kind), z)
    if direction is None:
        direction = -torch.softmax(z.detach(), -1)
        direction[k] += 1.0
    return float((g * direction).sum())


def bucketed_div(mu_lp: torch.Tensor, z: torch.Tensor, support_ids: list[int], kind: str) -> torch.Tensor:
    """D(mû || pî(z)) with the unseen tokens merged into one bucket (the aggregated estimator's target)."""
    v = z.shape[0]
    unseen = [j for j in range(v) if j not in support_ids]
    pi = torch.softmax(z, -1)
    mu = mu_lp.exp()
    idx = torch.tensor(support_ids, dtype=torch.long)
    mu_b = torch.cat([mu[idx], mu[unseen].sum().reshape(1)]) if unseen else mu[idx]
    pi_b = torch.cat([pi[idx], pi[unseen].sum().reshape(1)]) if unseen else pi[idx]
    if kind == "kl":
        pos = mu_b > 0
        return torch.where(pos, mu_b * (torch.log(torch.where(pos, mu_b, 1.0)) - torch.log(pi_b)), 0.0).sum()
    return 0.5 * (mu_b - pi_b).abs().sum()


def test_reference_closed_forms_match_autograd():
    """The plain closed forms agree with autograd on full logits (sanity of the references)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        r = make_row(gen, 7, 3, zero_mass=bool(torch.rand(1, generator=gen) < 0.5))
        mu, pi = r.mu_lp.exp().tolist(), r.pi_lp.exp().tolist()
        assert abs(ddot_kl_plain(mu, pi, r.k) - autograd_ddot(r.mu_lp, r.z, r.k, "kl")) < 1e-12
        assert abs(ddot_tv_plain(mu, pi, r.k) - autograd_ddot(r.mu_lp, r.z, r.k, "tv")) < 1e-12
