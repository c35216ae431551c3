import numpy as np

from areal_flow.graph import build_graph
from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.rewards.worker import score_group
from areal_flow.transport.messages import Array, GroupDone, Sample

NODES = {
    "generate": {"type": "generate", "role": "actor", "inputs": ["question"], "outputs": ["prompt_ids", "output_ids",
                 "behav_logprobs"], "mesh": "0"},
    "reward": {"type": "reward", "fn": "arith", "inputs": ["output_ids", "gold"], "outputs": ["correct"]},
    "train": {"type": "train", "role": "actor", "mesh": "1",
              "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "correct"]},
}


def test_each_sample_is_scored_against_its_own_reference_field():
    tok = build_char_tokenizer()
    graph = build_graph(NODES, ["question", "gold"], 2, ["arith"])

    def sample(i: int, text: str) -> Sample:
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        return Sample(uid=f"g0-{i}", prompt_id="p", group_id=0, index=i, birth_time=0.0,
                      fields={"question": "7+8=", "gold": "15"}, arrays={"output_ids": Array.of(np.array(ids, np.int32))})

    group = score_group(GroupDone(0, [sample(0, "7+8+0=15;#### 15"), sample(1, "7+8+0=15;#### 16"),
                                      sample(2, "7+8+0=15;")]), graph, tok)
    assert [s.scalars["correct"] for s in group.samples] == [1.0, 0.0, 0.0]
