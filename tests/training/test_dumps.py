"""Sample dumps (training/dumps.py): which steps, the file's name, its records' values, atomic writing,
and the trainer rank's call with its graph's keys and tokenizer."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from areal_flow.algorithms.inputs import TrainInputs
from areal_flow.graph import graph_from_config
from areal_flow.launch import CONF_DIR
from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.runtime.spec import typed
from areal_flow.training import dumps
from areal_flow.training.dumps import dump_due, dump_path, dump_step, write_dump
from areal_flow.training.worker import ModelWorker
from areal_flow.transport.messages import Array, Finish, Sample

TOK = build_char_tokenizer()


def sample(group: int, index: int, answer: str, versions: list[int], reward: float,
           finish: Finish = Finish.STOP) -> Sample:
    out = np.array(TOK.encode(answer), dtype=np.int32)
    assert len(out) == len(versions)
    return Sample(uid=f"g{group}-{index}", prompt_id=f"p{group}", group_id=group, index=index, birth_time=0.0,
                  fields={"answer": "5"},
                  arrays={"prompt_ids": Array.of(np.array(TOK.encode("2+3="), dtype=np.int32)),
                          "output_ids": Array.of(out), "versions": Array.of(np.array(versions, dtype=np.int32))},
                  scalars={"rewards": reward, "format": 1.0}, finish=finish)


def decode(ids: np.ndarray) -> str:
    return TOK.decode(ids.tolist(), skip_special_tokens=False)


SAMPLES = [sample(7, 0, "5", [6], 1.0), sample(7, 1, "4444", [3, 3, 5, 6], 0.0, Finish.LENGTH)]
ADVANTAGES = [np.array([0.5], np.float32), np.array([-0.5, -0.5, -1.0, -1.0], np.float32)]


def test_every_nth_step_counted_from_one():
    assert [s for s in range(10) if dump_due(3, s)] == [2, 5, 8]  # the metrics rows' steps 3, 6, 9
    assert not any(dump_due(0, s) for s in range(10))  # 0: never
    assert all(dump_due(1, s) for s in range(3))
    assert dump_path("/run", 2, 1) == "/run/dumps/step-00000003-rank1.jsonl"


def test_a_dump_holds_each_sample_with_its_text_reward_versions_staleness_and_advantage(tmp_path):
    masks = [np.ones(1, bool), np.array([True, True, False, False])]
    path = dump_step(str(tmp_path), 6, 1, SAMPLES, prompt_key="prompt_ids", output_key="output_ids",
                     reward_key="rewards", versions_key="versions", advantages=ADVANTAGES, masks=masks, decode=decode)
    assert path == str(tmp_path / "dumps" / "step-00000007-rank1.jsonl")
    assert os.listdir(tmp_path / "dumps") == ["step-00000007-rank1.jsonl"]  # no temporary file left
    first, second = [json.loads(line) for line in open(path)]
    assert first["step"] == 7 and first["rank"] == 1 and first["group_id"] == 7 and first["index"] == 0
    assert first["uid"] == "g7-0" and first["prompt_id"] == "p7" and first["fields"] == {"answer": "5"}
    assert first["prompt"] == "2+3=" and first["answer"] == "5"
    assert first["reward"] == 1.0 and first["scalars"] == {"rewards": 1.0, "format": 1.0}
    assert first["finish"] == "stop" and first["lengths"] == {"prompt": 4, "answer": 1, "trained": 1}
    assert first["versions"] == {"6": 1} and first["staleness"] == 0 and first["staleness_mean"] == 0.0
    assert first["advantage"] == 0.5 and first["advantages"] == [0.5]
    # The step counted from 0 is the weights' version: tokens of versions 3, 3, 5, 6 at step 6.
    assert second["answer"] == "4444" and second["finish"] == "length" and second["reward"] == 0.0
    assert second["versions"] == {"3": 2, "5": 1, "6": 1}
    assert second["staleness"] == 3 and second["staleness_mean"] == pytest.approx((3 + 3 + 1 + 0) / 4)
    assert second["advantage"] == -0.5  # over the tokens in the loss only
    assert second["advantages"] == [-0.5, -0.5, -1.0, -1.0]
    assert second["lengths"] == {"prompt": 4, "answer": 4, "trained": 2}


def test_without_versions_or_advantages_those_fields_are_empty(tmp_path):
    path = dump_step(str(tmp_path), 0, 0, SAMPLES[:1], prompt_key="prompt_ids", output_key="output_ids",
                     reward_key="rewards", versions_key=None, advantages=None, masks=None, decode=decode)
    (record,) = [json.loads(line) for line in open(path)]
    assert record["versions"] == {} and record["staleness"] is None and record["staleness_mean"] is None
    assert record["advantage"] is None and record["advantages"] is None and record["lengths"]["trained"] == 1


def test_a_multi_turn_answer_is_dumped_in_its_parts_each_marked_by_who_wrote_it(tmp_path):
    turn = sample(3, 0, "12;34;5", [1] * 7, 1.0)
    turn.arrays["mask"] = Array.of(np.array([1, 1, 1, 0, 0, 0, 1], dtype=np.uint8))  # "34;" came from a tool
    path = dump_step(str(tmp_path), 0, 0, [turn, SAMPLES[0]], prompt_key="prompt_ids", output_key="output_ids",
                     reward_key="rewards", versions_key="versions", advantages=None, masks=None, decode=decode,
                     loss_mask_key="mask")
    multi, single = [json.loads(line) for line in open(path)]
    assert multi["turns"] == [{"by": "policy", "tokens": 3, "text": "12;"}, {"by": "env", "tokens": 3, "text": "34;"},
                              {"by": "policy", "tokens": 1, "text": "5"}]
    assert "".join(p["text"] for p in multi["turns"]) == multi["answer"]
    assert single["turns"] is None  # no loss_mask array: a one-turn answer of a recipe without one


def test_a_dump_is_renamed_into_place_whole(tmp_path, monkeypatch):
    path = str(tmp_path / "dumps" / "step-00000001-rank0.jsonl")
    seen = []
    real_replace = os.replace

    def replace(src, dst):  # at the rename, the temporary file is complete and the target absent
        seen.append((os.path.basename(src), open(src).read().count("\n"), os.path.exists(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(dumps.os, "replace", replace)
    write_dump(path, [{"a": 1}, {"a": 2}])
    (name, lines, existed), = seen
    assert name.startswith(".") and not name.endswith(".jsonl") and lines == 2 and not existed
    assert [json.loads(line) for line in open(path)] == [{"a": 1}, {"a": 2}]

    class Unserialisable:
        pass

    # A write that fails midway leaves neither a partial dump nor its temporary file.
    with pytest.raises(TypeError):
        write_dump(str(tmp_path / "dumps" / "step-00000002-rank0.jsonl"), [{"a": 1}, {"a": Unserialisable()}])
    assert os.listdir(tmp_path / "dumps") == ["step-00000001-rank0.jsonl"]


def test_the_trainer_rank_dumps_with_its_graphs_keys_and_the_policys_advantages(tmp_path):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = typed(compose("config", overrides=[f"output_dir={tmp_path}", "dump.every_steps=2"]))
    graph = graph_from_config(cfg)
    train = graph.train
    keys = {m: graph.input(train, m) for m in ("prompt_ids", "output_ids", "rewards")}
    samples = [sample(7, 0, "5", [6], 1.0)]
    for s in samples:  # under the names the recipe gave them
        s.arrays = {keys["prompt_ids"]: s.arrays["prompt_ids"], keys["output_ids"]: s.arrays["output_ids"],
                    graph.output(graph.generate, "versions"): s.arrays["versions"]}
        s.scalars = {keys["rewards"]: 1.0}
    worker = object.__new__(ModelWorker)
    inputs = TrainInputs([], {"advantages": ADVANTAGES[:1]}, loss_mask=[np.ones(1, bool)])
    worker.__dict__.update(cfg=cfg, graph=graph, rank=0, spec=SimpleNamespace(run_dir=str(tmp_path)), tokenizer=TOK,
                           runner=SimpleNamespace(policy_inputs=inputs))  # the step's loss inputs (StepRunner)
    worker.dump(5, samples)
    (record,) = [json.loads(line) for line in open(tmp_path / "dumps" / "step-00000006-rank0.jsonl")]
    assert record["prompt"] == "2+3=" and record["answer"] == "5" and record["reward"] == 1.0
    assert record["versions"] == {"6": 1} and record["advantage"] == 0.5


def test_with_tokens_a_dump_carries_every_array_exactly(tmp_path):
    lp = np.array([-0.1234567, -2.0000001e-3, -7.5], np.float32)
    s = sample(3, 0, "123", [4, 4, 5], 1.0)
    s.arrays["behav_logprobs"] = Array.of(lp)
    path = dump_step(str(tmp_path), 0, 0, [s], prompt_key="prompt_ids", output_key="output_ids", reward_key="rewards",
                     versions_key="versions", advantages=None, masks=None, decode=decode, arrays=True)
    (rec,) = [json.loads(line) for line in open(path)]
    assert sorted(rec["arrays"]) == ["behav_logprobs", "output_ids", "prompt_ids", "versions"]
    assert rec["arrays"]["versions"] == [4, 4, 5] and rec["arrays"]["output_ids"] == TOK.encode("123")
    assert np.array_equal(np.asarray(rec["arrays"]["behav_logprobs"], np.float32), lp)  # bit for bit
    path = dump_step(str(tmp_path), 1, 0, [s], prompt_key="prompt_ids", output_key="output_ids", reward_key="rewards",
                     versions_key="versions", advantages=None, masks=None, decode=decode)
    assert "arrays" not in json.loads(open(path).readline())  # off by default
