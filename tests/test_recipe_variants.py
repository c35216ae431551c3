"""The graph is the program: dropping, adding or renaming nodes in a recipe changes what runs.

Each variant is a complete recipe in a user folder (on Hydra's search path), derived from
recipes/tiny_arith.yaml, run end to end on the real processes for a few steps.
"""

import copy
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml
from run_helpers import ANSWERS_SOME, RECIPE_ETA, check_accounting, jsonl, launch, launch_recipe, steps_of

pytestmark = pytest.mark.slow

BASE_MODELS = [ANSWERS_SOME]  # bootstrapped ahead by conftest.py

BASE = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "tiny_arith.yaml").read_text())


def run_variant(tmp_path: Path, cache: Path, name: str, graph: dict, *overrides: str) -> Path:
    recipe = copy.deepcopy(BASE) | {"recipe": name, "graph": graph}
    folder = tmp_path / "recipes"
    (folder / "recipe").mkdir(parents=True)
    (folder / "recipe" / f"{name}.yaml").write_text("# @package _global_\n" + yaml.safe_dump(recipe))
    run_dir = tmp_path / name
    r = launch(run_dir, cache, f"recipe={name}", f"hydra.searchpath=[file://{folder}]", "eval_at_start=false",
               "eval_at_end=false", "total_steps=3", *overrides)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_accounting(run_dir, eta=RECIPE_ETA)
    return run_dir


def nodes_run(run_dir: Path) -> list[list[str]]:
    return [row["nodes"] for row in jsonl(run_dir / "trained-rank0.jsonl")]


def test_without_a_prox_node_it_trains_plain_ppo_against_the_behaviour_policy(tmp_path, run_cache):
    graph = copy.deepcopy(BASE["graph"])
    del graph["actor_prox"]
    graph["actor_train"]["inputs"].remove("prox_logprobs")
    # The SMALL model answers nothing right: every advantage is 0, so the answers are run only
    # with skipping off, which this check of every token's behaviour weight needs.
    run_dir = run_variant(tmp_path, run_cache, "no_prox", graph, "algorithm.skip_zero_advantage=false")
    assert nodes_run(run_dir) == [["actor_train"]] * 3
    for m in steps_of(run_dir):  # no π_prox: every token's behaviour weight is exactly 1
        assert m["train/skipped_tokens"] == 0
        assert m["train/behav_weight_sum"] == m["train/n_valid_tokens"] and m["train/behav_weight_max"] == 1.0


@pytest.fixture(scope="module")
def ref_broadcast_run(tmp_path_factory, run_cache) -> Path:
    """One run for two tests: a ref node with the KL term, its weights broadcast over gloo."""
    graph = copy.deepcopy(BASE["graph"])
    graph["actor_ref"] = {"type": "inference", "role": "ref", "inputs": ["prompt_ids", "output_ids"],
                          "outputs": ["ref_logprobs"], "mesh": "1", "micro_batch_tokens": 256}
    graph["actor_train"]["inputs"].append("ref_logprobs")
    return run_variant(tmp_path_factory.mktemp("ref"), run_cache, "with_ref", graph, "algorithm.kl_coef=0.05",
                       "algorithm.kl_target=1.0", "algorithm.kl_horizon=8",
                       "rollout.weight_update_mode=distributed", "rollout.weight_bucket_mb=1", "rollout.interrupt=true")


def test_a_ref_node_adds_a_reference_model_and_the_kl_term(ref_broadcast_run):
    run_dir = ref_broadcast_run
    # One optimizer step per update: π_prox is the trained logprobs themselves, so the prox node
    # does not run; the ref node does, before the train node.
    assert nodes_run(run_dir) == [["actor_ref", "actor_train"]] * 3
    steps = steps_of(run_dir)
    kl = [m["train/kl_sum"] for m in steps]
    # The loss carried the KL term at every step (the default recipe's has none). Step 1 trains
    # the start weights, which the ref model also holds, so its KL is 0 exactly; k3 is never < 0.
    assert len(kl) == 3 and kl[0] == pytest.approx(0.0, abs=1e-6) and min(kl) >= 0
    # Adaptive β: the KL stays far below the target, so β falls by the most a step allows,
    # 20 % × 8 samples (2 groups of 4) / horizon 8.
    coefs = [m["train/kl_coef"] for m in steps]
    assert all(m["train/kl_mean"] < 0.8 for m in steps)
    assert coefs == pytest.approx([0.05, 0.04, 0.032])


def test_two_reward_nodes_combine_by_their_declared_weights(tmp_path, run_cache):
    graph = copy.deepcopy(BASE["graph"])
    graph["reward"]["outputs"] = ["correct"]
    graph["format"] = {"type": "reward", "fn": "arith_format", "inputs": ["output_ids", "answer"], "outputs": ["formatted"]}
    graph["total"] = {"type": "combine", "inputs": ["correct", "formatted"], "outputs": ["rewards"],
                      "weights": {"correct": 1.0, "formatted": 0.25}}
    # Also another algorithm: RLOO advantages with two optimizer steps per update and π_prox
    # interpolated by version (no prox forward pass).
    run_dir = run_variant(tmp_path, run_cache, "two_rewards", graph, "algorithm=rloo", "algorithm.n_minibatches=2",
                          "algorithm.prox_logp=loglinear")
    for m in steps_of(run_dir):
        assert m["reward"] == pytest.approx(m["reward/correct"] + 0.25 * m["reward/formatted"])
        assert m["reward/formatted"] >= m["reward/correct"]  # a right answer is always well formed
        assert m["train/prox_seconds"] == 0.0
    assert nodes_run(run_dir) == [["actor_train"]] * 3


@pytest.fixture(scope="module")
def renamed_shm_run(tmp_path_factory, run_cache) -> tuple[Path, set]:
    """One run for two tests: renamed keys, its weights through /dev/shm with retracting updates."""
    graph = copy.deepcopy(BASE["graph"])
    graph["generate"]["outputs"] = ["q_ids", "a_ids", "a_logp", "a_ver"]
    graph["generate"]["keys"] = {"prompt_ids": "q_ids", "output_ids": "a_ids", "behav_logprobs": "a_logp",
                                 "versions": "a_ver"}
    graph["reward"] |= {"inputs": ["a_ids", "answer"], "outputs": ["score"]}
    graph["actor_prox"] |= {"inputs": ["q_ids", "a_ids"], "outputs": ["old_logp"], "keys": {"prox_logprobs": "old_logp"}}
    graph["actor_train"]["inputs"] = ["q_ids", "a_ids", "a_logp", "a_ver", "old_logp", "score"]
    before = set(Path("/dev/shm").glob("areal_flow-*"))
    # Without the shortcut the prox node runs every step, even for one optimizer step.
    run_dir = run_variant(tmp_path_factory.mktemp("renamed"), run_cache, "renamed", graph,
                          "algorithm.prox_shortcut=false", "rollout.weight_update_mode=shm", "rollout.interrupt=true",
                          "rollout.pause_mode=retract")
    return run_dir, before


def test_renamed_keys_are_followed_by_their_declared_meaning(renamed_shm_run):
    run_dir, _ = renamed_shm_run
    steps = steps_of(run_dir)
    assert all(m["response_length"] > 0 and sum(m["staleness_hist"]) > 0 for m in steps)
    # π_prox came from the renamed key, through a forward pass that took time.
    assert nodes_run(run_dir) == [["actor_prox", "actor_train"]] * 3
    assert all(m["train/prox_seconds"] > 0 for m in steps)


def test_weights_through_shared_memory_with_retracting_updates(renamed_shm_run):
    """rollout.weight_update_mode=shm: each version goes through /dev/shm, not the run directory,
    and is gone after the run; retracting updates keep the accounting exact."""
    run_dir, before = renamed_shm_run
    log = (run_dir / "logs" / "gen_server0.log").read_text()
    loaded = [line for line in log.splitlines() if "loaded, version" in line]
    assert len(loaded) == 3 and all("from /dev/shm/areal_flow-" in line for line in loaded)
    assert not (run_dir / "weights").exists()
    # Removed at the end: this run's folder (another run of the suite may hold one of its own meanwhile).
    (shm,) = {re.search(r"from (/dev/shm/areal_flow-[0-9a-f]+)/", line)[1] for line in loaded}
    assert Path(shm) not in before and not Path(shm).exists()


def test_weights_by_broadcast_from_trainer_rank_0_over_gloo(ref_broadcast_run):
    """rollout.weight_update_mode=distributed: each version goes from trainer rank 0 to the server
    in buckets over a gloo group (SGLang's /update_weights_from_distributed), never through a file,
    between the controller's pause and continue; the server's version advances with every step."""
    run_dir = ref_broadcast_run
    log = (run_dir / "logs" / "gen_server0.log").read_text()
    loaded = [line for line in log.splitlines() if "loaded, version" in line]
    assert all("from weights group 'weight_update_group'" in line for line in loaded)
    per_version = Counter(int(line.rsplit(" ", 1)[1]) for line in loaded)
    # The tiny model is 2.4 MB of fp32: three buckets of at most 1 MiB per version.
    assert sorted(per_version) == [1, 2, 3] and all(n == 3 for n in per_version.values()), per_version
    trainer = (run_dir / "logs" / "trainer0.log").read_text()
    assert "weights group 'weight_update_group': 1 server(s), 2 ranks, gloo" in trainer
    assert all(f"weight version {v} sent to 1 server(s)" in trainer for v in (1, 2, 3))
    assert not (run_dir / "weights").exists()
    assert all(m["update_seconds"] > 0 for m in steps_of(run_dir))


def test_a_critic_trains_beside_the_actor_and_is_saved_with_it(tmp_path, run_cache):
    """recipe=tiny_arith_ppo: a value head on the actor's architecture gives its values to GAE and
    learns from the targets; the checkpoint holds it in critic/."""
    run_dir = tmp_path / "ppo"
    # A model that answers some problems: all-zero rewards would give the critic nothing to learn.
    r = launch_recipe(run_dir, run_cache, "tiny_arith_ppo", *ANSWERS_SOME, "eval_at_start=false", "eval_at_end=false",
               "total_steps=3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_accounting(run_dir, eta=1, group_size=8)
    runs = nodes_run(run_dir)
    assert all(n[0] == "critic_values" and sorted(n[1:]) == ["actor_train", "critic_train"] for n in runs), runs
    steps = steps_of(run_dir)
    # The head starts at 0 (a fresh critic values every state 0), then learns.
    assert steps[0]["train/critic/value_sum"] == 0.0 and steps[-1]["train/critic/value_sum"] != 0.0
    assert all(m["train/critic/n_valid_tokens"] == m["train/n_valid_tokens"] > 0 for m in steps)
    assert sum(m["reward"] for m in steps) > 0
    config = json.loads((run_dir / "checkpoint" / "critic" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"] and len(config["id2label"]) == 1  # one value


def test_colocated_generation_and_training_take_turns_on_one_device_with_weights_by_handle(tmp_path, run_cache):
    """allocation 'embedded:d1 | torch:d1': the server and the trainer rank share device 0. For each
    step the server retracts its requests and frees its KV cache, the trainer steps, and the server
    goes on under the new weights, which trainer rank 0 hands it by handle (rollout.weight_update_mode
    =ipc: shared memory here, CUDA IPC on a GPU); no sample is lost or trained twice."""
    run_dir = run_variant(tmp_path, run_cache, "colocated", copy.deepcopy(BASE["graph"]),
                          "allocation=embedded:d1 | torch:d1", "cluster.n_devices=1", "rollout.interrupt=true",
                          "rollout.weight_update_mode=ipc", "rollout.weight_bucket_mb=1")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["graph"]["generate"]["mesh"] == config["graph"]["actor_train"]["mesh"] == "0"
    steps = steps_of(run_dir)
    assert len(steps) == 3 and all(m["gen/memory_releases"] == 1 for m in steps), steps
    loaded = [line for line in (run_dir / "logs" / "gen_server0.log").read_text().splitlines()
              if "loaded, version" in line]
    # The tiny model is 2.4 MB of fp32: three buckets of at most 1 MiB per version, each by handle.
    assert all("from tensors by handle" in line for line in loaded)
    assert Counter(int(line.rsplit(" ", 1)[1]) for line in loaded) == {1: 3, 2: 3, 3: 3}
    assert "sent to 1 server(s) by CUDA IPC" in (run_dir / "logs" / "trainer0.log").read_text()
    assert not (run_dir / "weights").exists()
