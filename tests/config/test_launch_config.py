"""The Hydra app as a user meets it: composition, overrides, errors, dry runs, user recipes."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]


def launch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.launch", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # 1.1-1.6 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_dry_run_prints_graph_and_placement_from_any_directory(tmp_path):
    r = launch("dry_run=true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "actor_prox: inference [actor] on mesh 1" in r.stdout
    assert "<- prox_logprobs (from actor_prox)" in r.stdout
    assert "gen_server0" in r.stdout and "trainer0" in r.stdout
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("metrics.jsonl"))


def test_cfg_job_prints_the_composed_config_with_overrides(tmp_path):
    r = launch("--cfg", "job", "rollout.max_staleness=7", "algorithm.lr=3e-5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "max_staleness: 7" in r.stdout and "lr: 3.0e-05" in r.stdout and "recipe: tiny_arith" in r.stdout


@pytest.mark.parametrize("override,expected", [
    ("rollout.max_stalenes=3", "max_stalenes"),
    ("total_steps=many", "total_steps"),
    ("algorithm.group_size=1.5", "algorithm.group_size"),
])
def test_unknown_keys_and_wrong_types_fail_before_anything_starts(tmp_path, override, expected):
    r = launch(override, cwd=tmp_path)
    assert r.returncode != 0
    assert expected in r.stderr
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("spec.json"))


def test_graph_errors_name_node_and_key_and_exit_non_zero(tmp_path):
    r = launch("graph.actor_train.mesh=0-1", cwd=tmp_path)
    assert r.returncode == 2
    assert "meshes of 'generate' (0) and 'actor_train' (0,1) overlap on device(s) 0: generation and training share " \
           "devices only when their meshes are the same (colocated)" in r.stdout
    # The trainer mesh is the train node's: the node that differs from it is named.
    assert "batch nodes 'actor_prox' (1) and 'actor_train' (0,1) differ (graph.actor_prox.mesh)" in r.stdout
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("spec.json"))


def user_recipe(folder: Path, name: str, text: str) -> None:
    (folder / "recipe").mkdir(parents=True, exist_ok=True)
    (folder / "recipe" / f"{name}.yaml").write_text(text)


def test_a_user_recipe_folder_on_the_search_path(tmp_path):
    base = (REPO / "recipes" / "tiny_arith.yaml").read_text()
    user_recipe(tmp_path / "mine", "wide", base.replace("recipe: tiny_arith", "recipe: wide")
                .replace("group_size: 8", "group_size: 4"))
    r = launch("recipe=wide", f"hydra.searchpath=[file://{tmp_path / 'mine'}]", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "recipe: wide" in r.stdout and "group_size: 4" in r.stdout


def test_malformed_yaml_names_file_and_line(tmp_path):
    user_recipe(tmp_path / "mine", "broken", "# @package _global_\ngraph:\n  generate: {type: generate\n  x: [\n")
    r = launch("recipe=broken", f"hydra.searchpath=[file://{tmp_path / 'mine'}]", "dry_run=true", cwd=tmp_path)
    assert r.returncode == 2
    assert f"malformed YAML in {tmp_path / 'mine' / 'recipe' / 'broken.yaml'}, line 4" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_missing_dataset_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    r = launch("dataset.name=jsonl", f"dataset.train_path={missing}", f"dataset.eval_path={missing}",
               f"cache_dir={tmp_path}/cache", cwd=tmp_path)
    assert r.returncode == 2
    assert str(missing) in r.stdout and "does not exist" in r.stdout


def test_a_dataset_row_missing_a_field_names_file_and_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2="}\n')
    r = launch("dataset.name=jsonl", f"dataset.train_path={data}", f"dataset.eval_path={data}",
               f"cache_dir={tmp_path}/cache", cwd=tmp_path)
    assert r.returncode == 2
    assert f"{data}:2: missing field 'answer'" in r.stdout


def test_a_bad_areal_code_row_names_file_line_and_field(tmp_path):
    data = tmp_path / "code.jsonl"
    data.write_text('{"query_id": "a", "prompt": "p", "input_output": {"inputs": ["1"], "outputs": ["1"]}}\n'
                    '{"query_id": "b", "prompt": "p", "input_output": {"inputs": ["1", "2", "3"], "outputs": ["1", "2"]}}\n')
    r = launch("dataset.name=areal_code", f"dataset.train_path={data}", f"dataset.eval_path={data}",
               "dataset.fields=[prompt,input_output]", "graph.reward.inputs=[output_ids,input_output]",
               f"cache_dir={tmp_path}/cache", cwd=tmp_path)
    assert r.returncode == 2
    assert f"{data}:2: input_output: 'inputs' has 3 cases, 'outputs' has 2" in r.stdout


@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_multirun_gives_each_run_its_own_directory(tmp_path):
    # How long a run goes and how it resumes is not in its directory's name: the same multirun with
    # more steps and resume=auto finds each job's directory again (docs/reliability.md).
    r = launch("-m", "dry_run=true", "rollout.max_staleness=0,4", f"cache_dir={tmp_path}/c", "total_steps=7",
               "resume=auto", "checkpoint.every_steps=3", "recover.retries=1", f"hydra.sweep.dir={tmp_path}/sweep",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    runs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert runs == ["rollout.max_staleness=0", "rollout.max_staleness=4"]
    for eta, name in zip((0, 4), runs):
        overrides = (tmp_path / "sweep" / name / ".hydra" / "overrides.yaml").read_text()
        assert f"rollout.max_staleness={eta}" in overrides


def test_values_that_would_hang_or_mislead_are_refused_naming_the_key(tmp_path):
    r = launch("rollout.max_concurrent=0", "algorithm.batch_size=0", "cluster.n_devices=64",
               "model.path=/nonexistent/model", "launcher.type=kubernetes", "algorithm.max_new_tokens=5000",
               "metrics.backends=[tensorboard]", cwd=tmp_path)
    assert r.returncode == 2
    for expected in ("rollout.max_concurrent=0 must be ≥ 1", "algorithm.batch_size=0 must be ≥ 1",
                     "cluster.n_devices=64 but this process may use", "model.path='/nonexistent/model'",
                     "launcher.type='kubernetes' must be one of local",
                     "graph.actor_train.micro_batch_tokens=4096 cannot hold one sequence of a prompt and "
                     "algorithm.max_new_tokens=5000 answer tokens",
                     "metrics.backends=['tensorboard'] must include jsonl"):
        assert expected in r.stdout


@pytest.mark.slow  # seconds of waiting on a timeout or a process: the full suite runs it
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_and_several_local_nodes_are_refused_but_a_dry_run_places_them(tmp_path):
    r = launch("cluster.device_type=cuda", "cluster.n_nodes=2", "generation.tp_size=2", cwd=tmp_path)
    assert r.returncode == 2
    assert f"cluster.device_type='cuda' but torch {torch.__version__} sees no GPU on this machine" in r.stdout
    assert "generation.tp_size=2 with cluster.device_type='cuda': the embedded engine runs on one GPU" in r.stdout
    assert "cluster.n_nodes=2: launcher.type=local starts processes on this host only" in r.stdout
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("spec.json"))
    r = launch("recipe=tiny_arith_megatron", "cluster.device_type=cuda", "cluster.n_nodes=2", "cluster.n_devices=8",
               "allocation=sglang:d4t2 + megatron:d2p2t2", "dry_run=true", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "graph.actor_train.parallel=d2p2t2, graph.actor_train.engine=megatron" in r.stdout
    assert "actor_train: train [actor] on mesh 8-15" in r.stdout and "placement on 2 nodes:" in r.stdout
    assert "gen_server3    node 0   gpu 6,7" in r.stdout and "trainer7       node 1   gpu 7" in r.stdout
    assert "--tp-size 2" in r.stdout  # the sglang servers' command lines follow the allocation


@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_a_bad_allocation_points_at_the_character_and_one_too_big_names_the_cluster(tmp_path):
    r = launch("allocation=sglang:d4 + megatron:d2q2", "dry_run=true", cwd=tmp_path)
    assert r.returncode == 2
    assert "unknown size 'q'" in r.stdout and "(character 24)" in r.stdout
    assert "    sglang:d4 + megatron:d2q2\n" + " " * 27 + "^" in r.stdout
    r = launch("allocation=embedded:d2 + torch:d1", "dry_run=true", cwd=tmp_path)
    assert r.returncode == 2 and "needs 2 + 1 = 3 devices, the cluster has 1 node(s) × 2 = 2" in r.stdout


def test_the_yaml_check_covers_the_files_hydra_reads_through_a_linked_recipe_folder(tmp_path):
    # conf/recipe is a link to recipes/: a recipe read through such a link is checked as read, by
    # its real path. The check parses only what Hydra reads (tests/config/test_recipe_files.py).
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "bad.yaml").write_text("a: [1, 2\n")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "recipe").symlink_to(tmp_path / "recipes", target_is_directory=True)
    r = launch("recipe=bad", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 2
    assert f"malformed YAML in {tmp_path / 'recipes' / 'bad.yaml'}, line 2" in r.stderr
    assert "Traceback" not in r.stderr
    r = launch(f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 0, r.stderr  # the default recipe: bad.yaml is never read


@pytest.mark.slow  # 1.1-1.6 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_config_groups_select_algorithm_and_metrics_and_the_recipe_sits_on_top(tmp_path):
    r = launch("--cfg", "job", "algorithm=dr_grpo", "metrics=wandb", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load(r.stdout)
    assert job["algorithm"]["reward_norm"]["std_level"] == "none" and job["metrics"]["backends"] == ["jsonl", "wandb"]
    assert job["algorithm"]["loss_agg"] == "seq-mean-token-sum-norm"
    assert job["algorithm"]["group_size"] == 8  # from the recipe
    job = yaml.safe_load(launch("--cfg", "job", cwd=tmp_path).stdout)
    assert job["algorithm"]["reward_norm"]["std_level"] == "group" and job["algorithm"]["correction"] == "areal"


def test_weights_in_shared_memory_need_a_writable_dev_shm(monkeypatch, tmp_path):
    from areal_flow.run import checks
    from areal_flow.config.schema import RolloutConfig, RunConfig

    cfg = RunConfig(rollout=RolloutConfig(weight_update_mode="shm"))
    assert not any("shm" in p for p in checks._machine(cfg))  # this machine has /dev/shm
    monkeypatch.setattr(checks, "SHARED_MEMORY", str(tmp_path / "missing"))
    assert any(p.startswith("rollout.weight_update_mode='shm' needs a writable ") and "/missing" in p
               for p in checks._machine(cfg))


def test_weights_by_broadcast_need_interrupting_updates():
    """Buckets load as they arrive: without a pause, requests admitted between two buckets would
    decode on a mix of old and new weights."""
    from areal_flow.run import checks
    from areal_flow.config.schema import RolloutConfig, RunConfig

    cfg = RunConfig(rollout=RolloutConfig(weight_update_mode="distributed", interrupt=False))
    assert any(p.startswith("rollout.weight_update_mode='distributed' needs rollout.interrupt=true")
               for p in checks._rollout(cfg))
    kept = RunConfig(rollout=RolloutConfig(weight_update_mode="shm", keep_weights_every=10))
    assert checks._rollout(kept) == [
        "rollout.keep_weights_every=10 keeps published weights on disk, which rollout.weight_update_mode='shm' does "
        "not write (or removes at the end): use rollout.weight_update_mode=disk"]
    for mode, interrupt in (("distributed", True), ("disk", False)):
        assert checks._rollout(RunConfig(rollout=RolloutConfig(weight_update_mode=mode, interrupt=interrupt))) == []


@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_a_colocated_allocation_places_both_on_one_device_and_refuses_what_cannot_take_turns(tmp_path):
    r = launch("dry_run=true", "allocation=embedded:d1 | torch:d1", "cluster.n_devices=1", "rollout.interrupt=true",
               cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "colocated: generation and training take turns on mesh 0" in r.stdout
    assert "gen_server0    core 0" in r.stdout and "trainer0       core 0" in r.stdout
    r = launch("dry_run=true", "allocation=embedded:d1 | torch:d1", "cluster.n_devices=1", "cluster.device_type=cuda",
               "rollout.interrupt=false", "rollout.weight_update_mode=distributed", cwd=tmp_path)
    assert r.returncode == 2
    assert "generation and training share mesh 0 (colocated), which needs rollout.interrupt=true" in r.stdout
    assert "NCCL cannot broadcast between two processes on one GPU" in r.stdout


@pytest.mark.parametrize("override,expected", [
    ("algorithm.eps_clip=nan", "algorithm.eps_clip=nan: must be a finite number"),
    ("algorithm.betas=[0.9,inf]", "algorithm.betas[1]=inf: must be a finite number"),
])
def test_nan_and_inf_fail_before_anything_starts(tmp_path, override, expected):
    r = launch(override, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert expected in r.stdout + r.stderr
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("spec.json"))


def test_a_key_added_with_plus_fails_before_anything_starts(tmp_path):
    # Hydra itself suggests '+foo.bar=1' for an unknown key; it passed the launcher and every child
    # died of it with a traceback.
    r = launch("+foo.bar=1", "+algorithm.eps_clp=0.1", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "foo: unknown key, the config (RunConfig) has no field 'foo'" in r.stdout
    assert "did you mean algorithm.eps_clip?" in r.stdout
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("spec.json"))


def test_a_model_path_with_a_corrupt_config_json_fails_before_anything_starts(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2",\n')
    for name in ("tokenizer.json", "tokenizer_config.json"):  # present, so that only config.json is wrong
        (model / name).write_text("{}")
    r = launch(f"model.path={model}", f"cache_dir={tmp_path}/cache", "dataset.n_train=20", "dataset.n_eval=4",
               cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"model.path: {model}/config.json is not valid JSON (" in r.stdout
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("spec.json"))


def test_a_long_multirun_job_name_is_cut_and_hashed_under_the_file_systems_limit():
    from areal_flow.launch import NAME_BYTES, short_name

    short = "rollout.max_staleness=4,seed=1"
    assert short_name(short) == short  # a name that fits is the overrides themselves
    overrides = [f"algorithm.key_{i}={'x' * 12}" for i in range(20)]
    long_a, long_b = ",".join(overrides), ",".join(overrides[:-1] + ["algorithm.key_19=y"])
    a, b = short_name(long_a), short_name(long_b)
    assert len(a.encode()) <= NAME_BYTES and len(b.encode()) <= NAME_BYTES
    assert a == short_name(long_a) and a != b  # the same overrides give the same folder, others another
    assert a.startswith("algorithm.key_0=") and long_a.startswith(a.rsplit(",", 1)[0])
    assert len(short_name("é" * 300).encode()) <= NAME_BYTES  # cut on a character, not inside one


def test_an_eta_past_what_the_recipe_was_shown_to_hold_warns_at_launch():
    from areal_flow.config.schema import RolloutConfig, RunConfig
    from areal_flow.run.checks import staleness_warning

    def cfg(eta: int, shown: int | None) -> RunConfig:
        return RunConfig(recipe="tiny_arith", rollout=RolloutConfig(max_staleness=eta, staleness_shown=shown))

    assert staleness_warning(cfg(4, 4)) is None and staleness_warning(cfg(8, None)) is None
    warning = staleness_warning(cfg(8, 4))
    assert warning.startswith("rollout.max_staleness=8: recipe tiny_arith was shown") and "up to η = 4" in warning


@pytest.mark.slow  # two dry-run launches, about 3 s
def test_the_default_recipe_warns_at_launch_past_the_staleness_it_was_shown_to_hold(tmp_path):
    r = launch("dry_run=true", "rollout.max_staleness=8", f"cache_dir={tmp_path}/c", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "warning: rollout.max_staleness=8: recipe tiny_arith was shown to end as well as synchronous " \
           "training only up to η = 2" in " ".join(r.stdout.split())
    quiet = launch("dry_run=true", "rollout.max_staleness=2", f"cache_dir={tmp_path}/c", cwd=tmp_path)
    assert quiet.returncode == 0 and "warning:" not in quiet.stdout
