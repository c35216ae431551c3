"""The critic's clipped value loss (PPO; AReaL's critic loss, docs/algorithms.md)."""

from __future__ import annotations

import torch

Stats = dict[str, torch.Tensor]

VALUE_LOSSES = ("mse", "huber")


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    value_clip: float | None = 0.2,
    kind: str = "mse",
    huber_delta: float = 10.0,
    n_valid_tokens: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Clipped value loss, summed over valid tokens and divided by `n_valid_tokens`.

    `values` (V_θ) carries the gradient; `old_values` (the critic before this update) and `returns`
    (the GAE targets) are constants. With f(v) = ½(v − R)² (mse) or Huber(v − R; δ):

        v_clip = old + clip(v − old, −value_clip, value_clip)
        loss_t = max(f(v_t), f(v_clip_t))          (f(v_t) alone when value_clip is None)

    The max picks the pessimistic branch, selected with `where` so that the gradient flows through
    exactly one: a token whose clipped value is the worse one gets no gradient. Masked positions
    contribute nothing, even if their inputs are inf/NaN. `n_valid_tokens` defaults to mask.sum()
    (≥ 1); unlike AReaL's, an all-masked batch gives 0, not NaN.

    Returns (loss, stats): detached 0-d sums `n_tokens`, `value_clipped_tokens`, `value_error_sum`
    (of |v − R|), and `value_sum` (of v), so callers add them over micro-batches and ranks.
    """
    _check(values, old_values, returns, mask, value_clip=value_clip, kind=kind)
    mask = mask.bool()
    zero = torch.zeros_like(values)
    v = torch.where(mask, values, zero)
    old = torch.where(mask, old_values.detach().to(v.dtype), zero)
    ret = torch.where(mask, returns.detach().to(v.dtype), zero)
    plain = _pointwise(v, ret, kind, huber_delta)
    if value_clip is None:
        took_clip = torch.zeros_like(mask)
        per_token = plain
    else:
        clipped = _pointwise(old + torch.clamp(v - old, -value_clip, value_clip), ret, kind, huber_delta)
        took_clip = mask & (clipped > plain)
        per_token = torch.where(took_clip, clipped, plain)
    per_token = torch.where(mask, per_token, zero)
    denom = mask.sum().clamp(min=1).to(v.dtype) if n_valid_tokens is None else max(float(n_valid_tokens), 1.0)
    loss = per_token.sum() / denom
    stats: Stats = {
        "n_tokens": mask.sum().detach().to(v.dtype),
        "value_clipped_tokens": took_clip.sum().detach().to(v.dtype),
        "value_error_sum": torch.where(mask, (v - ret).abs(), zero).sum().detach(),
        "value_sum": v.sum().detach(),
    }
    return loss, stats


def _check(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
           value_clip: float | None, kind: str) -> None:
    if kind not in VALUE_LOSSES:
        raise ValueError(f"value loss kind must be one of {', '.join(VALUE_LOSSES)}, got {kind!r}")
    if value_clip is not None and value_clip <= 0:
        raise ValueError(f"value_clip must be > 0 (or None for no clipping), got {value_clip}")
    for name, t in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if t.shape != values.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, values has {tuple(values.shape)}")


def _pointwise(x: torch.Tensor, ret: torch.Tensor, kind: str, huber_delta: float) -> torch.Tensor:
    """f(x) per token: ½(x − R)² (mse) or Huber(x − R; δ)."""
    d = x - ret
    if kind == "mse":
        return 0.5 * d * d
    return torch.nn.functional.huber_loss(x, ret, reduction="none", delta=huber_delta)
