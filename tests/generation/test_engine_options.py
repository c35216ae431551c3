"""The engine's options check themselves when made, before any model is loaded, naming the setting."""

from __future__ import annotations

import pytest

from areal_flow.generation.engine.options import EngineOptions


@pytest.mark.parametrize(("field", "value"), [
    ("max_batch_size", 0), ("max_total_tokens", 0), ("page_size", 0), ("chunked_prefill_size", 0),
    ("chunked_prefill_size", -2),
])
def test_a_bad_setting_is_refused_naming_it(field: str, value: int):
    with pytest.raises(ValueError, match=field):
        EngineOptions(**{field: value})


def test_an_unknown_setting_is_refused():
    with pytest.raises(TypeError, match="max_batch"):
        EngineOptions(max_batch=4)


def test_the_prefill_chunk_is_whole_prompts_for_minus_one_unset_or_batch_invariant_decoding():
    assert EngineOptions().prefill_chunk is None
    assert EngineOptions(chunked_prefill_size=-1).prefill_chunk is None
    assert EngineOptions(chunked_prefill_size=64).prefill_chunk == 64
    assert EngineOptions(chunked_prefill_size=64, batch_invariant=True).prefill_chunk is None


def test_the_engine_refuses_bad_options_before_loading_a_model(tmp_path):
    from areal_flow.generation.engine.generation_engine import GenerationEngine

    with pytest.raises(ValueError, match="page_size"):  # the path holds no model: never read
        GenerationEngine(str(tmp_path / "no-model"), page_size=0)
