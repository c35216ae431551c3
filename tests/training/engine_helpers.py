"""Shared by the engine tests: a tiny Qwen2, random packed sequences, PPO inputs, comparisons,
and a way to run a function on several gloo ranks in spawned processes."""

import datetime
import faulthandler
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from areal_flow.runtime.ports import free_ports
from areal_flow.algorithms.ppo import decoupled_ppo_loss
from areal_flow.training.engine import OptimSpec

VOCAB = 18


def save_tiny_qwen2(path, **overrides) -> str:
    """A 2-layer Qwen2 (GQA, untied unless overridden) saved as a Hugging Face directory."""
    config = transformers.Qwen2Config(**{
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "tie_word_embeddings": False, **overrides})
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def make_seqs(seed: int, n: int, max_prompt: int = 8, max_output: int = 12):
    rng = np.random.default_rng(seed)
    lengths = [(rng.integers(1, max_prompt + 1), rng.integers(0, max_output + 1)) for _ in range(n)]
    return [(rng.integers(0, VOCAB, p), rng.integers(0, VOCAB, o)) for p, o in lengths]


def make_token_data(seqs, seed: int) -> dict[str, list[np.ndarray]]:
    """PPO inputs near the tiny model's logprobs (about log 1/18): some ratios clip, some weights cap."""
    rng = np.random.default_rng(seed)
    prox = [np.log(1 / VOCAB) + 0.2 * rng.standard_normal(len(o)) for _, o in seqs]
    return {
        "prox_logprobs": prox,
        "behav_logprobs": [p + 0.4 * rng.standard_normal(len(p)) for p in prox],
        "advantages": [np.full(len(o), rng.choice([-1.0, 1.0])) for _, o in seqs],
    }


def ppo_loss_fn(logprobs, batch, mask, n_valid_tokens):
    return decoupled_ppo_loss(
        logprobs, batch["prox_logprobs"].float(), batch["behav_logprobs"].float(),
        batch["advantages"].float(), mask, eps_clip=0.2, behav_weight_cap=2.0, n_valid_tokens=n_valid_tokens,
    )


def neg_mean_logprob(logprobs, batch, mask, n_valid_tokens):
    loss = -(logprobs * mask).sum() / n_valid_tokens
    return loss, {"n_tokens": mask.sum().float()}


def reference_logprobs(model, seqs, temperature=1.0):
    """One ordinary, unpacked HF forward per sequence."""
    out = []
    with torch.no_grad():
        for prompt, output in seqs:
            ids = torch.from_numpy(np.concatenate([prompt, output]))[None]
            logp = (model(ids).logits[0] / temperature).log_softmax(-1)
            pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
            out.append(logp[pos, torch.from_numpy(output)].numpy())
    return out


def assert_all_close(xs, ys, atol):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


# Tests that compare the *weights* after a step between packings, rank layouts or engines (which
# reduce in different orders) take what is in effect a plain SGD step. Adam's update, lr·g/(|g|+eps)
# on the first step, divides by |g| where a gradient is near zero, so a rounding difference of 1e-10
# between two reduction orders becomes an update-sized difference there. With eps far above every
# gradient element (the tiny models' are below 0.1, clipped at norm 1) the update is lr·g/eps to
# within |g|/eps: linear in the gradient, so weights differ by lr/eps times the gradients' rounding.
# Losses, gradient norms and logprobs are compared directly, with relative tolerances.
SGD_LIKE = OptimSpec(lr=0.1, eps=1.0)
EXACT = dict(optim=SGD_LIKE)


def full_weights(engine):
    """Full weights by Hugging Face name (collective under FSDP: every rank calls it)."""
    return {name: t.clone() for bucket in engine.export_weights() for name, t in bucket}


def assert_same_weights(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


def free_port() -> int:
    return free_ports(1)[0]


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{str(i): i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def _rank_main(rank, world, port, fn, args, backend="gloo"):
    faulthandler.enable()  # a native crash in a rank prints its stacks into the test's output
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if "nccl" in backend:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 120, backend: str = "gloo") -> None:
    """fn(rank, *args) in `world` spawned processes joined in one `backend` group (gloo; with
    "cpu:gloo,cuda:nccl", rank r on GPU r); each must exit 0.

    A rank killed by a signal of its own (a crash in native code: faulthandler has printed its
    stacks) runs the whole group once more. torch 2.13's CPU collectives under FSDP2 corrupt the
    heap about once in 40,000 all-gathers (`malloc(): unaligned tcache chunk detected`, always in
    a gloo all-gather's wait; docs/architecture.md, "Training engines"), which a long test meets now
    and then. A failed assertion (exit 1) or a hang fails at once."""
    for attempt in (1, 2):
        codes, hung = _run_group(fn, world, args, timeout, backend)
        crashed = not hung and any(c is not None and c < 0 for c in codes)
        if not crashed or attempt == 2:
            break
        print(f"run_ranks: a rank crashed in native code (exit codes {codes}); running the group again",
              file=sys.stderr)
    assert codes == [0] * world, f"exit codes {codes}" + (" (a rank hung and was killed)" if hung else "")


def _run_group(fn, world, args, timeout, backend="gloo") -> tuple[list[int | None], bool]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, backend)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    hung = False
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
            hung = True
    return [p.exitcode for p in procs], hung


def zero_loss(logprobs, batch, mask, n_valid_tokens):
    """A loss with zero gradient everywhere: a step then only applies weight decay."""
    return logprobs.sum() * 0.0, {}


def assert_decayed_matrices_only(before, after, lr, weight_decay):
    """After a zero-gradient AdamW step: weight matrices shrank by lr·wd, biases and norms did not."""
    for name, b in before.items():
        factor = 1 - lr * weight_decay if b.ndim > 1 and not name.endswith(".bias") else 1.0
        torch.testing.assert_close(after[name], b * factor, atol=1e-7, rtol=0, msg=name)
    assert any(n.endswith(".bias") for n in before) and any(b.ndim == 1 for b in before.values())
