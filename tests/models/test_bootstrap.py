import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

from areal_flow.data.arith import completion_text, extract_answer, prompt_text
from areal_flow.models import bootstrap, supervised
from areal_flow.models.bootstrap import ensure_base_model
from areal_flow.models.model_cache import INFO_FILE, REQUIRED_FILES, publish_dir
from areal_flow.models.supervised import (
    greedy_accuracy,
    greedy_completions,
    supervised_batch,
)
from areal_flow.models.tokenizer import build_char_tokenizer, load_tokenizer

# Enough steps for the model to start writing "#### n" answers, so greedy checks mean something.
SHORT = dict(steps=40, batch_size=16, warmup_steps=10, seed=0, progress=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bootstrap_cache")


@pytest.fixture(scope="module")
def base_dir(cache, one_torch_thread):
    return ensure_base_model(str(cache), **SHORT)


def _snapshot(d):
    return {f: os.stat(os.path.join(d, f)).st_mtime_ns for f in os.listdir(d)}


def test_result_is_a_loadable_hf_directory_with_its_tokenizer(base_dir):
    assert set(REQUIRED_FILES) <= set(os.listdir(base_dir))
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    tok = load_tokenizer(base_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(tok) == 18
    assert sum(p.numel() for p in model.parameters()) == 596_608


def test_loss_goes_down(base_dir):
    info = json.loads(open(os.path.join(base_dir, INFO_FILE)).read())
    losses = info["losses"]
    assert len(losses) == SHORT["steps"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.75 * first, (first, last)


def test_second_call_reuses_the_directory_untouched(cache, base_dir):
    before = _snapshot(base_dir)
    again = ensure_base_model(str(cache), **SHORT)
    assert again == base_dir and _snapshot(base_dir) == before  # no retraining, no rewrite


def test_different_settings_get_a_different_directory(cache, base_dir):
    other = ensure_base_model(str(cache), **{**SHORT, "steps": 2, "batch_size": 4})
    assert other != base_dir and os.path.isdir(other) and os.path.isdir(base_dir)
    arch = ensure_base_model(str(cache), arch={"num_hidden_layers": 1}, steps=2, batch_size=4,
                             warmup_steps=1, progress=False)
    assert arch not in (other, base_dir)
    assert AutoModelForCausalLM.from_pretrained(arch).config.num_hidden_layers == 1


def test_loss_covers_completion_and_eos_only():
    tok = build_char_tokenizer()
    batch = supervised_batch(tok, [(prompt_text(a, b), completion_text(a, b)) for a, b in ((3, 4), (123, 4567))])
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    short = tok.decode(ids[0][mask[0] == 1])
    assert short == "3+4=3+4+0=7;#### 7<eos>"
    # Prompt "3+4=" (4 tokens) and the right padding are masked; the EOS is a target.
    assert (labels[0, :4] == -100).all() and (labels[0, mask[0] == 0] == -100).all()
    targets = labels[0][labels[0] != -100]
    assert tok.decode(targets) == "3+4+0=7;#### 7<eos>"
    assert tok.decode(labels[1][labels[1] != -100]).endswith("#### 4690<eos>")


def test_greedy_batched_left_padded_matches_one_by_one(base_dir):
    tok = load_tokenizer(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    prompts = ["3+4=", "12345678+9=", "56+7=", "8+0=", "905+36="]
    batched = greedy_completions(model, tok, prompts, max_new_tokens=40, batch_size=5)
    single = [greedy_completions(model, tok, [p], max_new_tokens=40)[0] for p in prompts]
    assert batched == single
    assert tok.padding_side == "right"  # the caller's tokenizer is left as it was

    # Score rows against what the model says: right where it gave an answer, wrong elsewhere.
    answers = [extract_answer(t) for t in single]
    assert any(a is not None for a in answers), single
    rows = [{"prompt": p, "answer": str(a if a is not None else 10**9)}
            for p, a in zip(prompts, answers)]
    expected = sum(a is not None for a in answers) / len(rows)
    assert greedy_accuracy(base_dir, rows, max_new_tokens=40, batch_size=2) == expected


def test_crash_while_saving_leaves_nothing_to_reuse(tmp_path, monkeypatch):
    # A leftover temp dir of a killed run must be ignored, not taken for a finished model.
    os.makedirs(tmp_path / ".tmp-tiny-qwen2-000000000000-dead")

    def die(*args, **kwargs):
        raise KeyboardInterrupt  # after model and tokenizer files were written

    monkeypatch.setattr(supervised.json, "dump", die)
    settings = dict(steps=2, batch_size=4, warmup_steps=1, progress=False)
    with pytest.raises(KeyboardInterrupt):
        ensure_base_model(str(tmp_path), **settings)
    dirs = [p for p in os.listdir(tmp_path) if not p.endswith(".lock")]
    assert dirs == [".tmp-tiny-qwen2-000000000000-dead"]
    monkeypatch.undo()
    done = ensure_base_model(str(tmp_path), **settings)
    assert set(REQUIRED_FILES) <= set(os.listdir(done))


def test_incomplete_directory_is_reported_not_reused(tmp_path, base_dir):
    damaged = tmp_path / os.path.basename(base_dir)
    shutil.copytree(base_dir, damaged)
    os.remove(damaged / "model.safetensors")
    with pytest.raises(RuntimeError, match="incomplete.*model.safetensors"):
        ensure_base_model(str(tmp_path), **SHORT)


def test_losing_a_publish_race_keeps_the_winner(tmp_path, base_dir):
    final = tmp_path / "final"
    shutil.copytree(base_dir, final)
    before = _snapshot(final)
    loser = tmp_path / "loser"
    loser.mkdir()
    (loser / "config.json").write_text("{}")
    publish_dir(str(loser), str(final))
    assert not loser.exists() and _snapshot(final) == before

    os.remove(final / "model.safetensors")  # a broken winner is not silently accepted
    loser.mkdir()
    (loser / "config.json").write_text("{}")
    with pytest.raises(OSError):
        publish_dir(str(loser), str(final))


@pytest.mark.slow  # processes of its own: the full suite runs it, the fast tier does not
def test_two_processes_racing_agree_on_one_directory(tmp_path):
    code = (
        "import sys, torch; torch.set_num_threads(1)\n"
        "from areal_flow.models.bootstrap import ensure_base_model\n"
        "print(ensure_base_model(sys.argv[1], steps=3, batch_size=4, warmup_steps=1,"
        " progress=False))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    entries = [e for e in os.listdir(tmp_path) if not e.endswith(".lock")]
    assert entries == [os.path.basename(outs[0])]
    assert set(REQUIRED_FILES) <= set(os.listdir(outs[0]))


def test_a_gpu_bootstrap_runs_in_a_child_process_and_its_failure_is_reported(tmp_path):
    """On cuda the launcher trains the bootstrap in a spawned child, so that the launcher, which lives
    as long as the run, holds no GPU memory. The same helper runs here on the CPU (with functions a
    fresh interpreter imports at once)."""
    bootstrap._in_child(os.makedirs, str(tmp_path / "made"))
    assert (tmp_path / "made").is_dir()
    with pytest.raises(RuntimeError, match="the bootstrap's training process exited with code 3"):
        bootstrap._in_child(os._exit, 3)


@pytest.mark.gpu
def test_the_bootstrap_trains_on_the_gpu_and_its_model_loads_on_the_cpu(tmp_path):
    model_dir = ensure_base_model(str(tmp_path), **SHORT, device="cuda")
    losses = json.loads(open(os.path.join(model_dir, INFO_FILE)).read())["losses"]
    assert sum(losses[-5:]) < 0.75 * sum(losses[:5])
    assert AutoModelForCausalLM.from_pretrained(model_dir).lm_head.weight.device.type == "cpu"
