"""The tiny Qwen2 of the CPU default recipe (596,608 parameters with the 18-token vocabulary)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

# The peer's shape (TRL's GRPOTrainer on the same task: docs/benchmarks.md); overrides go through `tiny_qwen2_config`.
TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def tiny_qwen2_config(tokenizer: PreTrainedTokenizerBase, **overrides: Any) -> Qwen2Config:
    """The tiny shape with vocab and special ids taken from `tokenizer`; `overrides` win.

    All fields go to the constructor at once because Qwen2Config derives per-layer settings
    (`layer_types`) from `num_hidden_layers` there. BOS is the EOS id, as in Qwen: the task has
    no BOS token and prompts do not start with one.
    """
    kwargs: dict[str, Any] = {
        **TINY_SHAPE,
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
    }
    # PretrainedConfig keeps unknown kwargs silently, so a typo ("hidden_sise") would be ignored.
    unknown = set(overrides) - set(Qwen2Config().to_dict()) - {"attn_implementation"}
    if unknown:
        raise ValueError(f"tiny_qwen2_config: unknown Qwen2Config field(s) {sorted(unknown)}")
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def build_tiny_qwen2(config: Qwen2Config) -> Qwen2ForCausalLM:
    """A freshly initialised fp32 model (initialisation follows torch's global RNG)."""
    return Qwen2ForCausalLM(config).to(torch.float32)
