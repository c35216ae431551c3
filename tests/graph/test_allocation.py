"""Allocation strings: parsed by the grammar, errors point at the character, fitted to the cluster,
written into the run config."""

import pytest
from omegaconf import OmegaConf

from areal_flow.graph.allocation import AllocationError, allocation_problems, apply_allocation, parse_allocation
from areal_flow.graph.layout import Layout


def test_the_papers_7b_allocation_gives_generation_then_training_devices():
    alloc = parse_allocation("sglang:d32t2 + megatron:d4p2t4")
    assert alloc.generation.backend == "sglang" and alloc.generation.layout == Layout(dp=32, tp=2)
    assert alloc.training.layout == Layout(dp=4, tp=4, pp=2) and alloc.training_engine == "megatron"
    assert alloc.generation_mesh == tuple(range(64)) and alloc.training_mesh == tuple(range(64, 96))


@pytest.mark.parametrize("text, gen, train, engine", [
    ("d2+d1", Layout(dp=2), Layout(), None),  # unnamed: first generates, second trains
    ("  embedded:t2 +fsdp:d2 ", Layout(tp=2), Layout(dp=2), "torch"),  # fsdp is the torch engine
    ("SGLang:t2d4 + Megatron:p2", Layout(dp=4, tp=2), Layout(pp=2), "megatron"),  # any order, any case
])
def test_backends_are_optional_and_sizes_come_in_any_order(text, gen, train, engine):
    alloc = parse_allocation(text)
    assert (alloc.generation.layout, alloc.training.layout, alloc.training_engine) == (gen, train, engine)


@pytest.mark.parametrize("text, message, column", [
    ("sglang:d32?2 + megatron:d4", "unexpected '?'", 11),
    ("sglang:d4 +", "the string ends where a part was expected", 12),
    ("", "the string ends where a part was expected", 1),
    ("vllm:d4 + megatron:d4", "unknown backend 'vllm'", 1),
    ("sglang:d4 + megatron:d4x2", "unknown size 'x'", 24),
    ("sglang:d4 + megatron:d4c2", "context parallel (c) is not supported", 24),
    ("sglang:d4 + megatron:d4d2", "'d' is given twice in one part", 24),
    ("sglang:d0 + megatron:d4", "d0: a size must be at least 1", 9),
    ("sglang:d4p2 + megatron:d4", "generation has no pipeline parallel", 10),
    ("sglang:d4 | megatron:d4 + torch:d2", "'|' colocates the two parts of an allocation", 11),
    ("sglang:d4 | megatron:d2", "parts joined by '|' share their devices, so their sizes must match: generation "
                                "has 4, training 2", 13),
    ("sglang:d4", "1 part(s); an allocation has two", 10),
    ("sglang:d4 + megatron:d4 + torch:d2", "3 part(s)", 27),
    ("megatron:d4 + sglang:d4", "'megatron' is a training backend", 1),
    ("sglang:d4 + embedded:d4", "'embedded' is a generation backend", 13),
])
def test_errors_point_at_the_character_that_is_wrong(text, message, column):
    with pytest.raises(AllocationError) as info:
        parse_allocation(text)
    first, shown, caret = str(info.value).split("\n")
    assert message in first and first.endswith(f"(character {column})")
    assert shown == f"    {text}" and caret == " " * (3 + column) + "^"


def test_what_does_not_fit_the_cluster_is_named():
    paper = parse_allocation("sglang:d32t2 + megatron:d4p2t4")
    assert allocation_problems(paper, n_nodes=12, per_node=8) == []
    [too_many] = allocation_problems(paper, n_nodes=8, per_node=8)
    assert "needs 64 + 32 = 96 devices, the cluster has 8 node(s) × 8 = 64" in too_many
    [wide] = allocation_problems(parse_allocation("sglang:t16 + megatron:d8"), n_nodes=4, per_node=8)
    assert "a generation server of t16 needs 16 devices on one node, a node has 8" in wide
    # 3 devices of generation put the first TP pair of training on devices 3 and 4: fine within a
    # node of 8, but no tensor-parallel group may cross from device 7 to 8.
    [straddle] = allocation_problems(parse_allocation("sglang:d3 + megatron:d4t2"), n_nodes=2, per_node=8)
    assert "a tensor-parallel group of t2 would straddle two nodes" in straddle and "start at 3" in straddle
    assert allocation_problems(parse_allocation("sglang:d4t2 + megatron:d3t2"), n_nodes=2, per_node=8) == []


def test_applied_to_a_config_it_places_the_generate_and_batch_nodes():
    raw = OmegaConf.create({
        "generation": {"backend": "embedded", "tp_size": 1},
        "graph": {"gen": {"type": "generate", "mesh": "0"}, "score": {"type": "reward"},
                  "prox": {"type": "inference", "mesh": "1"}, "train": {"type": "train", "mesh": "1"}},
    })
    lines = apply_allocation(raw, parse_allocation("sglang:d2t2 + megatron:d2t2"))
    assert raw.generation.backend == "sglang" and raw.generation.tp_size == 2
    assert raw.graph.gen.mesh == "0-3" and "parallel" not in raw.graph.gen and "mesh" not in raw.graph.score
    for node in (raw.graph.prox, raw.graph.train):
        assert (node.mesh, node.parallel, node.engine) == ("4-7", "d2p1t2", "megatron")
    assert "graph.train.parallel=d2p1t2" in lines and "generation.backend=sglang" in lines
    # Without backend names the configured backend and engines stay.
    raw.generation.backend = "embedded"
    apply_allocation(raw, parse_allocation("d1 + d1"))
    assert raw.generation.backend == "embedded" and raw.graph.train.engine == "megatron" and raw.graph.train.mesh == "1"


def test_a_colocated_allocation_puts_training_on_generations_devices():
    alloc = parse_allocation("embedded:d1 | fsdp:d1")
    assert alloc.colocated and alloc.n_devices == 1
    assert alloc.generation_mesh == alloc.training_mesh == (0,)
    assert str(alloc) == "embedded:d1t1 | fsdp:d1p1t1"
    eight = parse_allocation("sglang:d4t2 | megatron:d2t4")
    assert eight.training_mesh == tuple(range(8)) and eight.n_devices == 8
    assert allocation_problems(eight, n_nodes=1, per_node=8) == []
    assert "needs 8 devices, the cluster has 1 node(s) × 4 = 4" in allocation_problems(eight, n_nodes=1,
                                                                                        per_node=4)[0]
