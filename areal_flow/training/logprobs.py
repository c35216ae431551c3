"""Per-token logprobs and entropy of the LM head without materialising the [T, V] fp32 logits.

The full computation, `log_softmax((hidden @ weight.T + bias).float() / temperature)` gathered at
the targets, holds a [T, V] fp32 tensor (and its gradient): 10 GB for a 16k-token micro-batch of a
152k vocabulary. Here the tokens are taken `chunk_tokens` at a time: each chunk's logits are
computed in the compute dtype (the autocast dtype when autocast is on, else the hidden's), upcast
to fp32, reduced to per-token statistics, and freed. Forward keeps only O(T) numbers per token (the
logsumexp and the entropy); backward recomputes each chunk's logits from `hidden` and `weight`
(which the caller holds anyway) and accumulates the gradients of both. No step reads a value back
to the host, so a GPU never waits inside the loop.

On CUDA each chunk's math after the matmul (`_chunk_stats`, `_chunk_grad`) runs compiled
(`torch.compile`, whole graphs): on a GPU the head is bound by its fp32 passes over the [c, V]
chunk, not by the matmul, and the compiler fuses them into a few passes that read the logits in the
compute dtype. The same functions run eagerly on the CPU, and on CUDA after a compilation failed.

Memory bound: O(chunk_tokens × V) for the transient chunk buffers (in fp32: the logits, their
exponentials, and in backward the logit gradient, about 3 × chunk_tokens × V × 4 bytes, plus one
[chunk_tokens, V] copy in the compute dtype), O(T) saved for backward, and in backward one fp32
[V, H] accumulator for the weight's gradient (the size of the gradient itself).

`vocab_parallel_logprobs` is the same for a vocabulary split over tensor-parallel ranks (megatron):
each rank holds the rows [vocab_start, vocab_start + V/tp) of the weight, computes per-token
statistics of its shard, and the ranks combine them with two all-reduces of [T]-sized tensors per
call (a max and one sum), not per chunk. The gradient each rank returns for `hidden` is its own
partial one: the caller sums it over the group exactly once (megatron's
`copy_to_tensor_model_parallel_region`, or `gather_from_sequence_parallel_region` under sequence
parallelism, applied to the hidden before this call, as its ColumnParallelLinear does).

Math (z = logits / temperature, p = softmax(z), t the target):
    logp_t = z_t - lse,   H = lse - Σ_j p_j z_j
    ∂logp_t/∂z_j = 1[j=t] - p_j,   ∂H/∂z_j = -p_j (log p_j + H)
and ∂/∂logits = ∂/∂z / temperature.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

Output = tuple[torch.Tensor, torch.Tensor | None]


def full_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                  entropy: bool = False) -> Output:
    """The reference: logprobs [T] (and entropy [T]) from whole logits [T, V], in fp32. What the
    engines compute when the LM head cannot be routed through the chunked path."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None])[:, 0] - lse
    if not entropy:
        return logp, None
    log_p = z - lse[:, None]
    return logp, -(log_p.exp() * log_p).sum(-1)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                     temperature: float = 1.0, chunk_tokens: int = 1024, entropy: bool = False,
                     bias: torch.Tensor | None = None) -> Output:
    """(logp [T] fp32, entropy [T] fp32 or None) of `targets` [T] under
    log_softmax((hidden [T, H] @ weight[V, H].T + bias) / temperature), `chunk_tokens` tokens at a
    time (<= 0: one chunk). Differentiable w.r.t. hidden, weight and bias (both outputs); under
    no_grad nothing is kept. Memory: O(chunk_tokens × V) transient (module docstring)."""
    return _apply(hidden, weight, bias, targets, temperature, chunk_tokens, entropy, 0, None)


def vocab_parallel_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                            vocab_start: int, group: dist.ProcessGroup | None, temperature: float = 1.0,
                            chunk_tokens: int = 1024, entropy: bool = False,
                            bias: torch.Tensor | None = None) -> Output:
    """`chunked_logprobs` with the vocabulary split over the ranks of `group`: `weight` [V/tp, H]
    (and `bias`) are this rank's rows vocab_start..vocab_start + V/tp, `targets` are global vocabulary
    ids, and `hidden` is the same on every rank. Every rank returns the same logp and entropy; the
    gradient w.r.t. `hidden` is this rank's partial one (the caller sums it over the group once).
    Collective: every rank of `group` calls it with the same T (two [T]-sized all-reduces)."""
    return _apply(hidden, weight, bias, targets, temperature, chunk_tokens, entropy, vocab_start, group)


def _apply(hidden, weight, bias, targets, temperature, chunk_tokens, entropy, vocab_start, group) -> Output:
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [T, H] and weight [V, H], got hidden {tuple(hidden.shape)} "
                         f"and weight {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets has shape {tuple(targets.shape)}, hidden has {hidden.shape[0]} tokens")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = hidden.shape[0] if chunk_tokens <= 0 else chunk_tokens
    args = (hidden, weight, bias, targets, float(temperature), max(chunk, 1), bool(entropy), int(vocab_start), group)
    differentiable = any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if torch.is_grad_enabled() and differentiable:
        return _ChunkedLogprobs.apply(*args)
    with torch.no_grad():  # inference: no autograd node, nothing saved
        logp, lse, ent = _forward(*args)
    return logp, ent


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the LM head's matmul runs in: autocast's when it is on for this device (bf16 on a
    GPU), else the hidden's."""
    device = t.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype


def _head(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits h @ w.T + b [c, V] in h's (the compute) dtype."""
    logits = h @ w.T
    return logits if b is None else logits + b


def _chunk_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 z = logits / temperature of one chunk."""
    # A fresh tensor either way: scaled in place. At temperature 1 not at all: x / 1 is x, and the
    # division is a pass over the fp32 [c, V] chunk (on a GPU the head is bound by such passes).
    return _scaled(logits.float(), temperature)


def _chunk_stats(logits: torch.Tensor, local: torch.Tensor, temperature: float, want_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(target logit [c], lse [c], entropy [c] or None), fp32, of one chunk's logits [c, V] (the
    compute dtype) at temperature, the targets `local` [c] indexing its columns."""
    z = _chunk_logits(logits, temperature)
    target_logit = z.gather(1, local[:, None])[:, 0]
    m = z.amax(dim=-1, keepdim=True)
    y = z.sub_(m)  # z - max, in place: the chunk holds one fp32 [c, V] buffer plus exp(y)
    ex = y.exp()
    sum_ex = ex.sum(-1)
    lse = m[:, 0] + sum_ex.log()
    if not want_entropy:
        return target_logit, lse, None
    # H = log Σe^y - Σ e^y·y / Σe^y (shifted by the max: no cancellation); a batched row-wise dot
    # product, which allocates no second [c, V] buffer.
    dot = (ex[:, None, :] @ y[:, :, None])[:, 0, 0]
    return target_logit, lse, sum_ex.log() - dot / sum_ex


def _chunk_grad(logits: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None, g_logp: torch.Tensor,
                g_ent: torch.Tensor | None, local: torch.Tensor, onehot_grad: torch.Tensor,
                temperature: float) -> torch.Tensor:
    """d logits [c, V] in the logits' (the compute) dtype, of one chunk:
    dz = g_logp·(onehot_t - p) - g_ent·p·(log p + H), d logits = dz / temperature."""
    log_p = _chunk_logits(logits, temperature).sub_(lse[:, None])
    # dz = -p·coef with the minus folded into the [c, 1] factors rather than a neg_() pass over
    # [c, V]: IEEE rounding is symmetric in sign, so p·(-g) is -(p·g) exactly, and a·(-g_ent) -
    # g_logp is -(a·g_ent + g_logp) exactly (up to the sign of an exact 0).
    if g_ent is not None:
        p = log_p.exp()
        # -(g_logp + g_ent·(log p + H)), in place in the log p buffer
        neg_coef = log_p.add_(ent[:, None]).mul_(-g_ent[:, None].float()).sub_(g_logp[:, None].float())
        dz = p.mul_(neg_coef)
    else:
        dz = log_p.exp_().mul_(-g_logp[:, None].float())  # log p is not needed again: in place
    dz.scatter_add_(1, local[:, None], onehot_grad[:, None])
    return _scaled(dz, temperature).to(logits.dtype)


@functools.cache
def _compiled() -> tuple[Callable, Callable]:
    return (torch.compile(_chunk_stats, dynamic=True, fullgraph=True),
            torch.compile(_chunk_grad, dynamic=True, fullgraph=True))


_EAGER = (_chunk_stats, _chunk_grad)
_compile_failed = False


def _kernels(device: torch.device) -> tuple[Callable, Callable]:
    """The chunk's statistics and gradient: compiled on CUDA, where the fp32 passes over the [c, V]
    chunk (cast, max, shift, exp, sums; in backward exp, scale, add, cast) bound the head's time and
    the compiler fuses them into a few that read the logits in the compute dtype; eager elsewhere,
    and everywhere after a compilation failed (warned once)."""
    if device.type != "cuda" or _compile_failed or not COMPILE_ON_CUDA:
        return _EAGER
    stats, grad = _compiled()
    return _guarded(stats, 0), _guarded(grad, 1)


def _guarded(fn: Callable, which: int) -> Callable:
    def call(*args):
        global _compile_failed
        if _compile_failed:
            return _EAGER[which](*args)
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the compiler failed: the same math eagerly
            _compile_failed = True
            warnings.warn(f"the compiled LM-head chunk failed ({type(e).__name__}: {e}); computing it eagerly",
                          stacklevel=2)
            return _EAGER[which](*args)
    return call


COMPILE_ON_CUDA = True
"""Compile the head's chunk math on CUDA (`_kernels`); False keeps it eager (a comparison)."""


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x / temperature in place; x itself at temperature 1 (the same values, one pass fewer)."""
    return x if temperature == 1.0 else x.div_(temperature)


def _local_targets(targets: torch.Tensor, vocab_start: int, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as indices into this rank's rows (clamped), and whether each falls in them."""
    local = targets - vocab_start
    in_range = (local >= 0) & (local < n_local)
    return local.clamp(0, n_local - 1), in_range


def _forward(hidden, weight, bias, targets, temperature, chunk, want_entropy, vocab_start, group):
    """(logp [T], lse [T], entropy [T] or None), all fp32; the chunk loop of the forward pass."""
    cdtype = _compute_dtype(hidden)
    n, n_local = hidden.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    lse = torch.empty(n, **f32)
    target_logit = torch.empty(n, **f32)
    ent = torch.empty(n, **f32) if want_entropy else None
    local, in_range = _local_targets(targets, vocab_start, n_local)
    stats = _kernels(hidden.device)[0]
    with torch.autocast(hidden.device.type, enabled=False):  # the dtype is chosen here, explicitly
        w = weight.to(cdtype)
        b = None if bias is None else bias.to(cdtype)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logits = _head(hidden[s:e].to(cdtype), w, b)
            target_logit[s:e], lse[s:e], chunk_ent = stats(logits, local[s:e], temperature, ent is not None)
            if ent is not None:
                ent[s:e] = chunk_ent
            del logits
    if group is not None and dist.get_world_size(group) > 1:
        target_logit = torch.where(in_range, target_logit, torch.zeros_like(target_logit))
        lse, target_logit, ent = _combine_ranks(lse, target_logit, ent, group)
    return target_logit - lse, lse, ent


def _combine_ranks(lse_r, target_r, ent_r, group):
    """The global lse, target logit and entropy from each rank's statistics of its vocabulary shard:
    lse = M + log S with M = max_r lse_r, S = Σ_r exp(lse_r - M); the target logit is on one rank
    (0 on the others); H = Σ_r w_r (H_r + lse - lse_r) with w_r = exp(lse_r - lse), rewritten with
    Σ w_r = 1 as log S + Σ_r w_r (H_r - (lse_r - M)). Two all-reduces of [T]-sized tensors."""
    peak = lse_r.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    weight = (lse_r - peak).exp()
    parts = [weight, target_r] + ([] if ent_r is None else [weight * (ent_r - (lse_r - peak))])
    sums = torch.stack(parts)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    log_s = sums[0].log()
    ent = None if ent_r is None else log_s + sums[2] / sums[0]
    return peak + log_s, sums[1], ent


class _ChunkedLogprobs(torch.autograd.Function):
    """forward: (logp, entropy or None); backward recomputes each chunk's logits (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, want_entropy, vocab_start, group):
        logp, lse, ent = _forward(hidden, weight, bias, targets, temperature, chunk, want_entropy, vocab_start, group)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.config = (temperature, chunk, vocab_start, _compute_dtype(hidden))
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        temperature, chunk, vocab_start, cdtype = ctx.config
        grads = _backward(hidden, weight, bias, targets, lse, ent, g_logp, g_ent, temperature, chunk,
                          vocab_start, cdtype, ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None, None, None)


def _backward(hidden, weight, bias, targets, lse, ent, g_logp, g_ent, temperature, chunk, vocab_start, cdtype,
              needs):
    """(d hidden, d weight, d bias), each None when not needed. Per chunk:
    dz = g_logp·(onehot_t - p) - g_ent·p·(log p + H), then d logits = dz / temperature."""
    if g_logp is None and g_ent is None:
        return None, None, None
    n, n_local = hidden.shape[0], weight.shape[0]
    if g_logp is None:
        g_logp = torch.zeros_like(lse)
    local, in_range = _local_targets(targets, vocab_start, n_local)
    onehot_grad = torch.where(in_range, g_logp.float(), torch.zeros_like(lse))  # the target's own term
    acc = torch.promote_types(weight.dtype, torch.float32)  # chunks add up in fp32 at least
    d_hidden = torch.empty_like(hidden) if needs[0] else None
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None
    d_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if bias is not None and needs[2] else None
    grad = _kernels(hidden.device)[1]
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(cdtype)
        b = None if bias is None else bias.to(cdtype)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e].to(cdtype)
            d_logits = grad(_head(h, w, b), lse[s:e], None if ent is None else ent[s:e], g_logp[s:e],
                            None if g_ent is None else g_ent[s:e], local[s:e], onehot_grad[s:e], temperature)
            if d_hidden is not None:
                d_hidden[s:e] = (d_logits @ w).to(hidden.dtype)
            if d_weight is not None:
                if d_weight.dtype == cdtype:
                    d_weight.addmm_(d_logits.T, h)
                else:  # bf16 compute: the chunk's [V, H] product, added into the fp32 accumulator
                    d_weight += d_logits.T @ h
            if d_bias is not None:
                d_bias += d_logits.sum(0)
            del d_logits
    return (d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype))
