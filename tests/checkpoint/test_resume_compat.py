"""What a resumed run may change, and which checkpoint it continues from."""

import os

import pytest
from omegaconf import OmegaConf

from areal_flow.checkpoint import compat, store

SAVED = {"seed": 1, "total_steps": 10, "model": {"path": None, "arch": {}},
         "algorithm": {"lr": 1e-4, "lr_schedule": "constant", "lr_decay_steps": None, "eps_clip": 0.2},
         "graph": {"actor_train": {"type": "train", "mesh": "0", "micro_batch_tokens": 8192}},
         "dataset": {"name": "tiny_arith", "n_eval": 200}, "rollout": {"workers": 1}, "cluster": {"n_devices": 2}}


def changed(**edits):
    now = OmegaConf.to_container(OmegaConf.merge(SAVED, OmegaConf.from_dotlist([f"{k}={v}" for k, v in edits.items()])))
    return compat.changed_keys(SAVED, now), compat.lr_schedule_changed(SAVED, now)


def test_a_key_of_the_math_is_named():
    keys, _ = changed(**{"algorithm.eps_clip": 0.3})
    assert keys == ["algorithm.eps_clip: 0.2 -> 0.3"]
    assert changed(seed=2)[0] == ["seed: 1 -> 2"]
    assert changed(**{"graph.actor_train.type": "inference"})[0][0].startswith("graph.actor_train.type")


def test_how_the_run_runs_may_change():
    keys, schedule = changed(total_steps=20, **{"graph.actor_train.mesh": "0-1", "rollout.workers": 2,
                                                "graph.actor_train.micro_batch_tokens": 4096,
                                                "cluster.n_devices": 4, "dataset.n_eval": 50})
    assert keys == [] and schedule is None


def test_a_longer_run_with_a_decaying_schedule_needs_its_length():
    saved = {**SAVED, "algorithm": {**SAVED["algorithm"], "lr_schedule": "cosine"}}
    now = {**saved, "total_steps": 20}
    assert "algorithm.lr_decay_steps" in compat.lr_schedule_changed(saved, now)
    fixed = {**now, "algorithm": {**now["algorithm"], "lr_decay_steps": 100}}
    assert compat.changed_keys(saved, fixed) == ["algorithm.lr_decay_steps: None -> 100"]


def test_check_reads_the_checkpoints_config(tmp_path):
    tmp = store.begin(str(tmp_path), 2)
    OmegaConf.save(OmegaConf.create(SAVED), os.path.join(tmp, "config.yaml"))
    path = store.commit(tmp, 2)
    compat.check(path, OmegaConf.create(SAVED))
    with pytest.raises(compat.ResumeError, match=r"algorithm\.lr: 0\.0001 -> 0\.001"):
        compat.check(path, OmegaConf.merge(SAVED, {"algorithm": {"lr": 1e-3}}))


def test_a_node_key_written_at_its_default_is_the_node_that_leaves_it_out(tmp_path):
    # The config holds graph nodes as written: a default spelled out must not read as a change.
    tmp = store.begin(str(tmp_path), 2)
    OmegaConf.save(OmegaConf.create(SAVED), os.path.join(tmp, "config.yaml"))
    path = store.commit(tmp, 2)
    compat.check(path, OmegaConf.merge(SAVED, {"graph": {"actor_train": {"keys": {}, "inputs": []}}}))
    with pytest.raises(compat.ResumeError, match=r"graph\.actor_train\.outputs: \[\] -> \['x'\]"):
        compat.check(path, OmegaConf.merge(SAVED, {"graph": {"actor_train": {"outputs": ["x"]}}}))


def test_a_ref_node_moved_off_the_trainer_mesh_is_refused_since_the_saved_groups_lack_its_key(tmp_path):
    train = {"type": "train", "role": "actor", "mesh": "1", "inputs": ["ref_logprobs"]}
    ref = {"type": "inference", "role": "ref", "mesh": "1", "outputs": ["ref_logprobs"]}
    on_trainer = {**SAVED, "graph": {"ref": ref, "actor_train": train}}
    tmp = store.begin(str(tmp_path), 2)
    OmegaConf.save(OmegaConf.create(on_trainer), os.path.join(tmp, "config.yaml"))
    path = store.commit(tmp, 2)
    own = OmegaConf.merge(on_trainer, {"graph": {"ref": {"mesh": "2"}}})
    with pytest.raises(compat.ResumeError) as e:
        compat.check(path, own)
    assert ("node 'ref' ran on the trainer ranks (graph.ref.mesh='1') and this run puts it on a mesh of its own ('2'): "
            "the scored groups the checkpoint holds have no ref_logprobs yet") in str(e.value)
    assert "resume with graph.ref.mesh='1', or start a new run" in str(e.value)
    compat.check(path, OmegaConf.create(on_trainer))  # where it was: as before
    # The other way, the saved groups have the key already and the trainer ranks compute it again.
    assert compat.moved_off_trainer(compat.with_typed_graph(OmegaConf.to_container(own)),
                                    compat.with_typed_graph(on_trainer)) == []


def test_a_path_resumes_its_own_run(tmp_path):
    tmp = store.begin(str(tmp_path), 2)
    path = store.commit(tmp, 2)
    assert compat.find(path, "/elsewhere") == (path, str(tmp_path))
    with pytest.raises(compat.ResumeError, match="no such checkpoint"):
        compat.find(str(tmp_path / "nope"), str(tmp_path))
    os.remove(os.path.join(path, store.MANIFEST))
    with pytest.raises(compat.ResumeError, match="not a complete checkpoint"):
        compat.find(path, str(tmp_path))


def test_restarts_need_a_checkpoint_to_restart_from():
    from areal_flow.run import checks
    from areal_flow.config.schema import CheckpointConfig, LauncherConfig, RecoverConfig, RunConfig

    problems = checks._rollout(RunConfig(recover=RecoverConfig(retries=2)))
    assert problems == ["recover.retries=2 restarts a run from its last checkpoint, and this run saves none before its "
                        "end: set checkpoint.every_steps or checkpoint.every_minutes"]
    assert checks._rollout(RunConfig(recover=RecoverConfig(retries=2), checkpoint=CheckpointConfig(every_minutes=5))) == []
    slurm = RunConfig(recover=RecoverConfig(retries=1), checkpoint=CheckpointConfig(every_steps=5),
                      launcher=LauncherConfig(type="slurm"))
    assert "requeue the job with resume=auto" in checks._rollout(slurm)[0]


def test_a_judge_added_or_its_prompt_or_model_changed_is_refused_but_it_may_move(tmp_path):
    """A judge's answers are rewards: what it is and how it is asked is the run's math; where its
    servers run is not."""
    judge = {"type": "generate", "role": "judge", "mesh": "1", "inputs": ["prompt", "output_ids"],
             "outputs": ["judge_ids"], "template": "{prompt}", "model": None}
    with_judge = {**SAVED, "graph": {**SAVED["graph"], "judge": judge}}

    def saved(conf: dict, sub: str) -> str:
        tmp = store.begin(str(tmp_path / sub), 2)
        OmegaConf.save(OmegaConf.create(conf), os.path.join(tmp, "config.yaml"))
        return store.commit(tmp, 2)

    path = saved(with_judge, "judged")
    for edit, named in (({"template": "{prompt} {response}"}, r"graph\.judge\.template"),
                        ({"model": "/models/other"}, r"graph\.judge\.model"),
                        ({"temperature": 0.5}, r"graph\.judge\.temperature")):
        with pytest.raises(compat.ResumeError, match=named):
            compat.check(path, OmegaConf.merge(with_judge, {"graph": {"judge": edit}}))
    compat.check(path, OmegaConf.merge(with_judge, {"graph": {"judge": {"mesh": "2"}}}))  # moved: fine
    with pytest.raises(compat.ResumeError, match=r"graph\.judge"):  # a judge the saved run did not have
        compat.check(saved(SAVED, "plain"), OmegaConf.create(with_judge))
