"""The engines' options check themselves when made, naming the key, before any model is loaded; and
the state every engine keeps beside its model travels with checkpoints."""

import pytest

from areal_flow.training.engine import EngineBase, EngineOptions, NonFiniteLoss, OptimSpec
from areal_flow.training.torch_engine import TorchOptions


@pytest.mark.parametrize("key, value, message", [
    ("micro_batch_tokens", 0, "micro_batch_tokens must be >= 1, got 0"),
    ("temperature", 0.0, "temperature must be > 0, got 0.0"),
    ("logprob_chunk_tokens", -1, r"logprob_chunk_tokens must be >= 0 \(0: one chunk\), got -1"),
])
def test_every_engine_option_out_of_range_is_refused_naming_its_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions(**{key: value})
    with pytest.raises(ValueError, match=message):  # the torch engine's options check the shared ones too
        TorchOptions(**{key: value})


def test_the_torch_options_refuse_an_unknown_head_and_an_unknown_key():
    with pytest.raises(ValueError, match="head must be one of lm, value, got 'policy'"):
        TorchOptions(head="policy")
    with pytest.raises(TypeError, match="tp"):  # a megatron option is not the torch engine's
        TorchOptions(tp=2)
    assert TorchOptions(head="value", row_tokens=16).micro_batch_tokens == 4096  # the shared defaults


def test_the_megatron_options_refuse_sequence_parallelism_without_tensor_parallelism():
    megatron = pytest.importorskip("areal_flow.training.megatron.engine")
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs tensor parallelism \(tp > 1\)"):
        megatron.MegatronOptions(sequence_parallel=True)
    assert megatron.MegatronOptions(tp=2, sequence_parallel=True).sequence_parallel
    with pytest.raises(ValueError, match="temperature must be > 0"):
        megatron.MegatronOptions(temperature=-1.0)


def test_non_finite_steps_in_a_row_raise_at_the_limit_and_a_finite_one_resets_the_count():
    engine = EngineBase(EngineOptions(), OptimSpec(max_nan_steps=3))
    engine._count_non_finite()
    engine._count_non_finite()
    assert engine._nan_in_a_row == 2
    with pytest.raises(NonFiniteLoss, match="3 train steps in a row .*max_nan_steps=3"):
        engine._count_non_finite()


def test_the_counters_a_checkpoint_saves_are_restored_as_they_were_and_not_shared():
    saved = EngineBase(EngineOptions(micro_batch_tokens=64), OptimSpec())
    saved.version, saved._nan_in_a_row, saved.extra_state = 7, 1, {"kl": {"coef": 0.5}}
    counters = saved._counters()
    assert counters == {"version": 7, "nan_in_a_row": 1, "extra": {"kl": {"coef": 0.5}}}
    resumed = EngineBase(EngineOptions(), OptimSpec())
    resumed._restore_counters(counters)
    assert (resumed.version, resumed._nan_in_a_row, resumed.extra_state) == (7, 1, {"kl": {"coef": 0.5}})
    resumed.extra_state["new"] = 1
    assert "new" not in counters["extra"] and "new" not in saved.extra_state
    assert resumed.micro_batch_tokens == 4096 and saved.micro_batch_tokens == 64  # the budget is the options'
