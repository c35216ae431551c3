"""Advantages: reward/advantage normalisation (GRPO, Dr.GRPO, RLOO, batch levels), GAE, token rewards."""

from __future__ import annotations

from typing import Callable

import torch

LEVELS = ("group", "batch", "none")


def normalize(x: torch.Tensor, *, group_size: int, mean_level: str = "group", std_level: str = "group",
              leave_one_out: bool = False, std_unbiased: bool = True, eps: float = 1e-6,
              mask: torch.Tensor | None = None, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
              ) -> torch.Tensor:
    """Centre and scale `x` at a chosen level (AReaL's NormConfig).

    x: [N] (one value per sequence) or [N, T] (padded token values); `mask` (bool, x's shape, default all
    valid) marks the valid entries. Groups are contiguous blocks of `group_size` rows (N % group_size == 0).

        out = (x - μ) / (σ + eps)   at valid entries,   0 at masked ones

    μ by `mean_level`: "group" = mean of the group's valid entries, "batch" = mean of all valid entries,
    "none" = 0. With `leave_one_out` (RLOO, group level only) μ for row i is the mean of the valid entries
    of the OTHER rows of its group; when they have none (e.g. group_size 1), μ = x, so the output is 0.
    σ by `std_level`: the standard deviation of x over the same entries, around that level's own mean
    (unbiased: divide by n - 1, else by n); σ = 1 when that count is <= 1 or σ is 0. "none" means no scaling at
    all: out = x - μ, without eps, so none/none is the identity at valid positions. (AReaL instead takes
    σ around the μ in use; the two agree whenever mean_level == std_level and there is no leave-one-out.)

    `all_reduce` (data parallel: each rank holds whole groups of one batch) takes a float64 tensor and
    returns its sum over ranks; batch-level statistics pass through it (`_batch_stats`), so every rank
    must then call `normalize` with the same levels (it is a collective). Group statistics never need it.
    A group whose valid values are all equal gets exactly 0 at group level (`_group_stats`).
    Statistics are accumulated in float64; the result has x's float dtype (the default one for ints).
    """
    mask = _checked_mask(x, mask, group_size, mean_level, std_level, leave_one_out)
    out_dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    # Zero the masked entries first, so that inf/NaN padding cannot reach any sum.
    v = torch.where(mask, x.to(torch.float64), zero)
    m = mask.to(torch.float64)
    # [G, group_size, T'] with T' = 1 for per-sequence values; every statistic below broadcasts against it.
    shape3 = (x.shape[0] // group_size, group_size, 1 if x.ndim == 1 else x.shape[1])
    v3 = v.reshape(shape3)
    means: dict[str, torch.Tensor] = {}
    stds: dict[str, torch.Tensor] = {}
    if "group" in (mean_level, std_level):
        means["group"], stds["group"] = _group_stats(v3, m.reshape(shape3), leave_one_out, std_unbiased)
    if "batch" in (mean_level, std_level):
        means["batch"], stds["batch"] = _batch_stats(v, m, all_reduce, std_unbiased)
    centred = v3 if mean_level == "none" else v3 - means[mean_level]
    scaled = centred if std_level == "none" else centred / (stds[std_level] + eps)
    return torch.where(mask, scaled.reshape(x.shape), zero).to(out_dtype)


def _checked_mask(x: torch.Tensor, mask: torch.Tensor | None, group_size: int, mean_level: str, std_level: str,
                  leave_one_out: bool) -> torch.Tensor:
    """`normalize`'s arguments checked; its mask as bool (all valid when None)."""
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in LEVELS:
            raise ValueError(f"{name} must be one of {LEVELS}, got {level!r}")
    if leave_one_out and mean_level != "group":
        raise ValueError(f"leave_one_out needs mean_level='group', got {mean_level!r}")
    if x.ndim not in (1, 2):
        raise ValueError(f"x must be [N] or [N, T], got shape {tuple(x.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n_rows = x.shape[0]
    if n_rows % group_size != 0:
        raise ValueError(f"the number of rows ({n_rows}) is not divisible by group_size ({group_size})")
    if mask is None:
        return torch.ones(x.shape, dtype=torch.bool, device=x.device)
    if mask.shape != x.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, x has {tuple(x.shape)}")
    return mask.bool()


def _group_stats(v3: torch.Tensor, m3: torch.Tensor, leave_one_out: bool,
                 std_unbiased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(μ to centre by, σ) of each group, broadcastable against v3 [G, group_size, T'] (masked entries 0,
    m3 their float mask). μ is the group's mean, or with `leave_one_out` the other rows' mean (x itself
    where they have no valid entry); σ is around the group's own mean.

    The sums are shifted by the group's first valid value: the deviations of an all-equal group are
    then exactly 0 whatever the float rounding (so is its output), and shifted sums lose less precision
    than raw ones."""
    n_g = m3.sum(dim=(1, 2), keepdim=True)
    flat = (v3.shape[0], v3.shape[1] * v3.shape[2])  # not -1: that is ambiguous for an empty batch
    flat_v, flat_m = v3.reshape(flat), m3.reshape(flat)
    if flat[1] == 0:  # no entries at all (a trainer rank with no samples: [0, 0]): nothing to shift by
        ref = torch.zeros((v3.shape[0], 1, 1), dtype=torch.float64, device=v3.device)
    else:
        first = flat_m.argmax(dim=1, keepdim=True)  # index of the first valid entry (0 when none)
        ref = flat_v.gather(1, first).reshape(-1, 1, 1)  # masked entries are 0, so an empty group gets 0
    dev = (v3 - ref) * m3
    s_g = dev.sum(dim=(1, 2), keepdim=True)
    group_mean = ref + s_g / n_g.clamp(min=1)
    centre = group_mean
    if leave_one_out:
        n_other = n_g - m3.sum(dim=2, keepdim=True)
        s_other = s_g - dev.sum(dim=2, keepdim=True)
        loo = ref + s_other / n_other.clamp(min=1)
        centre = torch.where(n_other > 0, loo, v3)  # nobody else to compare with: μ = x gives exactly 0
    sq = (((v3 - group_mean) * m3) ** 2).sum(dim=(1, 2), keepdim=True)
    return centre, _std_from(sq, n_g, std_unbiased)


def _batch_stats(v: torch.Tensor, m: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None,
                 std_unbiased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(μ, σ) over every valid entry of the batch (v: masked entries 0, m: the float mask), from
    (count, Σx, Σx²) passed once through `all_reduce` when given, so that every rank gets the same."""
    sums = torch.stack([m.sum(), v.sum(), (v * v).sum()])
    if all_reduce is not None:
        sums = all_reduce(sums)
    n_b, s1, s2 = sums[0], sums[1], sums[2]
    batch_mean = s1 / n_b.clamp(min=1)
    # Σ(x - μ)² = Σx² - μ·Σx; rounding can make it slightly negative when all values are equal.
    return batch_mean, _std_from((s2 - batch_mean * s1).clamp(min=0), n_b, std_unbiased)


def _std_from(sum_sq: torch.Tensor, count: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """sqrt(Σ(x - μ)² / (n - 1)) (or / n); 1 where n <= 1 or the spread is exactly 0.

    There is nothing to scale then (the deviations are 0 too), and 1 keeps eps = 0 from giving 0/0.
    """
    denom = (count - 1) if unbiased else count
    std = (sum_sq / denom.clamp(min=1)).sqrt()
    return torch.where((count > 1) & (std > 0), std, torch.ones_like(std))


def group_normalized_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """Advantage of each sample relative to the other answers to the same prompt.

    rewards: [N], the answers of one prompt in contiguous blocks of `group_size` (N % group_size == 0).
    Returns [N] float: A = (r - mean_group) / (std_group + eps), with the unbiased std.

    A group whose rewards are all equal carries no signal and gets zeros (the numerator is exactly 0),
    and so does group_size 1, where there is nothing to compare with. `scale_by_std=False` gives
    A = r - mean_group (Dr.GRPO), which does not up-weight groups that are nearly all right or wrong.
    This is `normalize` with group mean and group (or no) std.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    return normalize(
        rewards, group_size=group_size, mean_level="group", std_level="group" if scale_by_std else "none", eps=eps
    )


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over padded token rows (Schulman et al. 2016).

    rewards, values, mask: [N, T]; values[t] = V(s_t), the critic's value of the state before token t.
    Walking each row backwards over its valid tokens:

        δ_t = r_t + γ·V_next − V_t
        A_t = δ_t + γλ·A_next
        returns_t = A_t + V_t

    where V_next / A_next belong to the next VALID token, and are 0 after the last one: a row that
    stopped at the length limit is treated as terminal too. Masked tokens inside a row (e.g. tool
    output) are skipped: V_next and A_next carry over them unchanged, as in AReaL, so the discount
    chain runs as if they were absent. Both outputs are 0 at masked positions and carry no gradient
    (they are targets). A reverse loop over T, vectorised over N.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [N, T], got shape {tuple(rewards.shape)}")
    for name, t in (("values", values), ("mask", mask)):
        if t.shape != rewards.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, rewards has {tuple(rewards.shape)}")
    mask = mask.bool()
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    # Zero the padding first so that garbage there cannot leak through the carried values.
    r = torch.where(mask, rewards.detach().to(dtype), zero)
    v = torch.where(mask, values.detach().to(dtype), zero)
    n, t_len = r.shape
    next_value = torch.zeros(n, dtype=dtype, device=r.device)
    next_adv = torch.zeros(n, dtype=dtype, device=r.device)
    columns = []
    for t in reversed(range(t_len)):
        valid = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        # Masked tokens leave the chain untouched: what follows them is what precedes them.
        next_adv = torch.where(valid, a, next_adv)
        next_value = torch.where(valid, v[:, t], next_value)
        columns.append(torch.where(valid, a, zero))
    if columns:
        adv = torch.stack(columns[::-1], dim=1)
    else:
        adv = torch.zeros_like(r)
    returns = torch.where(mask, adv + v, zero)
    return adv, returns


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token rewards for GAE: each row's score at its last valid token, plus an optional penalty.

    scores: [N]; mask: [N, T] bool; kl_penalty: [N, T], already signed (e.g. −β·kl).

        r[i, t] = scores[i]·[t = last valid token of row i] + kl_penalty[i, t]   (valid t),   0 elsewhere

    A row with no valid token gets nothing (its score has nowhere to go).
    """
    if mask.ndim != 2 or scores.shape != mask.shape[:1]:
        raise ValueError(f"scores must be [N] and mask [N, T], got {tuple(scores.shape)} and {tuple(mask.shape)}")
    if kl_penalty is not None and kl_penalty.shape != mask.shape:
        raise ValueError(f"kl_penalty has shape {tuple(kl_penalty.shape)}, mask has {tuple(mask.shape)}")
    mask = mask.bool()
    dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    positions = torch.arange(mask.shape[1], device=mask.device)
    # The last valid index is the largest valid position; -1 for an empty row, which matches nothing.
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)
    at_last = positions[None, :] == last[:, None]
    out = torch.where(at_last, scores.to(dtype)[:, None], zero)
    if kl_penalty is not None:
        out = out + torch.where(mask, kl_penalty.to(dtype), zero)
    return out
