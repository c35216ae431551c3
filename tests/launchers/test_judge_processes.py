"""A judge's processes: its servers' placement, ports and command lines (fresh, restarted, resumed),
the dry run and status views of them, and the launcher's checks of its model before any start."""

import json

import pytest
from judge_graphs import build, with_judge

from areal_flow.checkpoint import store
from areal_flow.config.schema import DatasetConfig, RolloutConfig, RunConfig, node_config
from areal_flow.config.validate import ConfigError
from areal_flow.graph import place
from areal_flow.launchers.slurm import port_names
from areal_flow.run import prepare, start
from areal_flow.run.dry_run import describe_servers
from areal_flow.run.ports import spec_with_ports
from areal_flow.status.run_files import server_urls
from areal_flow.status.snapshot import role_of

GRAPH = build(with_judge(mesh="2-3"), n_devices=4)


def judged_spec(**fields):
    placement = place(GRAPH, rollout_workers=1)
    ports = {name: 9000 + i for i, name in enumerate(port_names(placement))}
    spec = spec_with_ports(placement, ports, run_dir="/r", model_path="/m", train_path="/t", eval_path="/e",
                           judge_models={"judge": "/j"}, **fields)
    return placement, spec


def test_a_judge_gets_one_server_per_device_with_ports_after_the_others():
    placement, spec = judged_spec()
    servers = placement.of_role("judge_server")
    assert [(p.name, p.devices, p.rank, p.graph_node) for p in servers] == [
        ("judge_server0", (2,), 0, "judge"), ("judge_server1", (3,), 1, "judge")]
    assert port_names(placement) == ["gen_server0", "rollout0", "trainer0", "judge_server0", "judge_server1",
                                     "controller", "dist"]
    assert spec.judge_ports == {"judge": [9003, 9004]} and spec.gen_ports == [9000]
    assert spec.judge_urls("judge") == ["http://127.0.0.1:9003", "http://127.0.0.1:9004"]
    assert spec.judge_names("judge") == ["judge_server0", "judge_server1"] and spec.judge_urls("other") == []
    assert list(server_urls(spec)) == ["gen_server0", "judge_server0", "judge_server1"]
    assert role_of("judge_server1") == "judge_server" and role_of("gen_server0") == "gen_server"


class Recorder:
    def __init__(self):
        self.started = {}

    def start(self, proc, argv, env, again=None, restarts=0):
        self.started[proc.name] = (argv, again)


def arg(argv, flag):
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("resume", [False, True])
def test_judge_servers_start_from_their_model_at_version_0_and_restart_under_every_update_mode(resume, tmp_path,
                                                                                               monkeypatch):
    monkeypatch.setattr(store, "read_manifest", lambda path: {"version": 7})
    placement, spec = judged_spec(resume=str(tmp_path / "ckpt") if resume else "")
    cfg = RunConfig(rollout=RolloutConfig(weight_update_mode="distributed", interrupt=True))
    launcher = Recorder()
    start.start_processes(launcher, placement, spec, cfg)
    gen_argv, gen_again = launcher.started["gen_server0"]
    assert arg(gen_argv, "--model-path") == (str(tmp_path / "ckpt" / "actor") if resume else "/m")
    assert gen_again is None  # a trainer-sent channel: no copy to restart a policy server from
    for name, port in (("judge_server0", "9003"), ("judge_server1", "9004")):
        argv, again = launcher.started[name]
        assert (arg(argv, "--model-path"), arg(argv, "--weight-version"), arg(argv, "--port")) == ("/j", "0", port)
        assert again is not None and again() == (argv, {})


def test_the_dry_run_lists_each_judges_servers_and_model():
    cfg = RunConfig(graph={n: node_config(n, c) for n, c in with_judge(mesh="2-3", model="/models/j").items()})
    text = describe_servers(cfg, build(with_judge(mesh="2-3", model="/models/j"), 4), place(GRAPH, 1))
    assert "judge servers of 'judge' (model /models/j, never updated):" in text
    assert "judge_server1: " in text and "--model-path /models/j" in text


def tiny_model(folder, positions=64, chat_template=None):
    from transformers import Qwen2Config

    from areal_flow.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    Qwen2Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=positions).save_pretrained(folder)
    return str(folder)


def judge_check(tmp_path, rows, **judge):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"id": f"p{i}", **row}) + "\n" for i, row in enumerate(rows)))
    cfg = RunConfig(dataset=DatasetConfig(name="jsonl", fields=["prompt", "answer"]))
    return prepare.prepare_judges(cfg, build(with_judge(**judge)), tiny_model(tmp_path / "start"), str(train))


def test_the_launcher_checks_a_judges_model_tokenizer_and_room_by_name(tmp_path):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "12345678+87654321=", "answer": "99999999"}]
    assert judge_check(tmp_path, rows, max_new_tokens=46) == {"judge": str(tmp_path / "start")}  # 18 + 46 = 64
    with pytest.raises(ConfigError) as e:
        judge_check(tmp_path, rows, model=str(tmp_path / "nowhere"))
    assert e.value.problems == [f"node 'judge': graph.judge.model='{tmp_path / 'nowhere'}' is not a Hugging Face "
                                "model directory (no config.json)"]
    with pytest.raises(ConfigError) as e:
        judge_check(tmp_path, rows, max_new_tokens=47)
    assert e.value.problems == [f"node 'judge': {tmp_path / 'train.jsonl'}:2 renders to 18 judge tokens before any "
                                f"answer; with graph.judge.max_new_tokens=47 that exceeds the judge's 64 positions "
                                f"(max_position_embeddings of {tmp_path / 'start'})"]
    with pytest.raises(ConfigError) as e:
        judge_check(tmp_path, rows, chat_template=True)
    assert e.value.problems[0].startswith("node 'judge': graph.judge.chat_template=true, but the tokenizer of ")
