"""A prompt longer than the model's context less the answer's budget is refused at launch naming
its file:line, or (dataset.long_prompts=skip) left out and counted once."""

import io
import json
import subprocess
import sys

import pytest
from rich.console import Console

from areal_flow.config.schema import AlgorithmConfig, DatasetConfig, RunConfig
from areal_flow.data.dataset import DatasetError
from areal_flow.models.tiny import tiny_qwen2_config
from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.run.prepare import check_prompt_room

LONG = "1" * 100_000  # a character tokenizer: one token each


@pytest.fixture
def model_and_data(tmp_path):
    """A model directory (its config, with 256 positions, and tokenizer; no weights: nothing here
    runs it) and a jsonl file whose second row's prompt is far over that context."""
    model = tmp_path / "model"
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(str(model))
    tiny_qwen2_config(tokenizer).save_pretrained(str(model))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "2"}) + "\n" for p in ("1+1=", LONG, "2+0=")))
    return model, data


def run_config(**dataset) -> RunConfig:
    return RunConfig(dataset=DatasetConfig(name="jsonl", **dataset), algorithm=AlgorithmConfig(max_new_tokens=16))


def test_a_prompt_over_the_context_is_refused_naming_its_file_and_line(model_and_data):
    model, data = model_and_data
    with pytest.raises(DatasetError) as e:
        check_prompt_room(run_config(), str(model), "prompt", [(str(data), "train")], Console(file=io.StringIO()))
    assert str(e.value) == (f"{data}:2: the prompt (field 'prompt') is 100000 tokens, over the 240 the model's context "
                            "leaves beside algorithm.max_new_tokens: shorten it, or set dataset.long_prompts=skip")


def test_skipped_prompts_are_left_out_and_counted_once(model_and_data):
    from areal_flow.data.loading import load_prompts

    model, data = model_and_data
    out = io.StringIO()
    cfg = run_config(long_prompts="skip")
    check_prompt_room(cfg, str(model), "prompt", [(str(data), "train")], Console(file=out, width=400))
    assert out.getvalue().splitlines() == [
        f"dataset.long_prompts=skip: 1 of 3 rows of {data} left out, their prompts over 240 tokens (the first: {data}:2)"]
    skipped = []
    rows = load_prompts(cfg.dataset, str(data), "train", "prompt", build_char_tokenizer(), 240, skipped)
    assert [r["prompt"] for r in rows] == ["1+1=", "2+0="] and skipped == [f"{data}:2"]
    data.write_text(json.dumps({"prompt": LONG, "answer": "2"}) + "\n")
    with pytest.raises(DatasetError, match="every prompt is over the 240 tokens"):
        check_prompt_room(cfg, str(model), "prompt", [(str(data), "train")], Console(file=io.StringIO()))


@pytest.mark.slow  # a real launcher: imports transformers
def test_the_launcher_refuses_a_long_prompt_in_one_line_before_any_process_starts(model_and_data, tmp_path):
    model, data = model_and_data
    r = subprocess.run([sys.executable, "-m", "areal_flow.launch", f"model.path={model}", "dataset.name=jsonl",
                        f"dataset.train_path={data}", f"dataset.eval_path={data}", f"hydra.run.dir={tmp_path}/run"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout.strip().startswith(f"error: {data}:2: the prompt (field 'prompt') is 100000 tokens, over the ")
    assert "Traceback" not in r.stdout + r.stderr and not (tmp_path / "run" / "spec.json").exists()


@pytest.mark.slow  # a real run
def test_a_run_with_skipped_long_prompts_trains_on_the_others_to_its_end(tmp_path, run_cache):
    """Three rows, one far over the context: four groups draw every row, so a long row that reached
    a rollout worker would stop the run there."""
    from run_helpers import launch

    rows = [{"prompt": "12+34=", "answer": "46"}, {"prompt": LONG, "answer": "1"}, {"prompt": "5+6=", "answer": "11"}]
    for name in ("train", "eval"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    r = launch(tmp_path / "run", run_cache, "dataset.name=jsonl", f"dataset.train_path={tmp_path}/train.jsonl",
               f"dataset.eval_path={tmp_path}/eval.jsonl", "dataset.long_prompts=skip", "total_steps=2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    said = [line for line in r.stdout.splitlines() if line.startswith("dataset.long_prompts=skip:")]
    assert said == [f"dataset.long_prompts=skip: 1 of 3 rows of {tmp_path}/{name}.jsonl left out, their prompts over "
                    f"{256 - 96} tokens (the first: {tmp_path}/{name}.jsonl:2)" for name in ("train", "eval")]
