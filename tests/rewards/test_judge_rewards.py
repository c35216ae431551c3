"""A reward node that reads a judge's answer: its reference text, decoded with the judge's
tokenizer, and the two functions that read a verdict; where the judge's numbers are logged."""

import numpy as np
from judge_graphs import build, with_judge

from areal_flow.controller.intake import group_problem
from areal_flow.controller.run_metrics import batch_metrics
from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.rewards.functions import judge_agree, judge_reward
from areal_flow.rewards.worker import reference_text
from areal_flow.transport.messages import Array, GroupMeta, Sample, SampleMeta


class Upper:
    """A judge tokenizer of its own: decodes to what the char tokenizer would, upper-cased."""

    def decode(self, ids, skip_special_tokens=True):
        return build_char_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens).upper() + "!"


def test_the_reference_is_the_dataset_field_or_the_judges_answer_in_its_own_tokenizer():
    graph, tok = build(with_judge()), build_char_tokenizer()
    verdict = tok.encode("#### 3", add_special_tokens=False) + [tok.eos_token_id]
    sample = Sample(uid="g0-0", prompt_id="p", group_id=0, index=0, birth_time=0.0, fields={"answer": "3"},
                    arrays={"judge_ids": Array.of(np.array(verdict, np.int32))})
    assert reference_text(sample, graph, graph.nodes["reward"], {}) == "3"
    assert reference_text(sample, graph, graph.nodes["judge_reward"], {"judge": Upper()}) == "#### 3!"


def test_the_verdict_functions_parse_the_judges_last_answer_line():
    assert judge_reward("anything", "looks right #### 1") == {"reward": 1.0, "unparsed": 0.0}
    assert judge_reward("", "#### 2 then #### 7.5") == {"reward": 7.5, "unparsed": 0.0}
    assert judge_reward("", "no verdict") == {"reward": 0.0, "unparsed": 1.0}
    assert judge_agree("1+2=3;#### 3", "1+2=3;#### 3") == {"reward": 1.0, "unparsed": 0.0}
    assert judge_agree("#### 4", "#### 3") == {"reward": 0.0, "unparsed": 0.0}
    assert judge_agree("no answer", "nothing") == {"reward": 0.0, "unparsed": 1.0}


def test_a_sample_without_its_verdict_is_dropped_by_name_and_judge_numbers_log_apart():
    lengths = {"prompt_ids": 3, "output_ids": 4}
    meta = SampleMeta("g0-0", 0, lengths, {0: 4}, {"rewards": 1.0, "judge_tokens": 5.0, "judge_reward_raw": 1.0},
                      0)
    assert group_problem(GroupMeta(0, "w", [meta]), 1, ["output_ids", "judge_ids"], ["output_ids"], "rewards") == \
        "sample g0-0 lacks ['judge_ids']"
    m = batch_metrics([GroupMeta(0, "w", [meta])], step=1, reward_key="rewards", output_key="output_ids",
                      judges=["judge"])
    assert m["judge/judge_tokens"] == 5.0 and m["reward/judge_reward_raw"] == 1.0
