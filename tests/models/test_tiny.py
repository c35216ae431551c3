import pytest
import torch

from areal_flow.models.tiny import build_tiny_qwen2, tiny_qwen2_config
from areal_flow.models.tokenizer import build_char_tokenizer


def _params(model):
    return sum(p.numel() for p in model.parameters())


def test_default_shape_has_the_peers_parameter_count():
    tok = build_char_tokenizer()
    config = tiny_qwen2_config(tok)
    assert (config.vocab_size, config.pad_token_id, config.eos_token_id) == (18, 0, 1)
    assert config.bos_token_id == 1 and not config.tie_word_embeddings
    model = build_tiny_qwen2(config)
    assert _params(model) == 596_608
    assert all(p.dtype == torch.float32 for p in model.parameters())
    logits = model(torch.tensor([[4, 13, 5, 14]])).logits
    assert logits.shape == (1, 4, 18)


def test_overrides_change_the_shape_and_typos_are_rejected():
    tok = build_char_tokenizer()
    config = tiny_qwen2_config(tok, num_hidden_layers=2)
    assert len(config.layer_types) == 2
    # Two of the four decoder layers (147,968 parameters each) are gone.
    assert _params(build_tiny_qwen2(config)) == 596_608 - 2 * 147_968
    with pytest.raises(ValueError, match="hidden_sise"):
        tiny_qwen2_config(tok, hidden_sise=64)
