"""Tiny real models, a real tokenizer, and plain-HF references for the generation tests.

(Not named conftest: test modules import from here, and every test folder has a conftest.)
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from areal_flow.generation.client.generation_client import wait_healthy
from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.generation.http.server import GenerationServer, serve

VOCAB_SIZE = 18
EOS_ID = 1
CONTEXT = 256
WORDS = ["<pad>", "<eos>", *"abcdefghijklmnop"]  # one word per id: 18 = VOCAB_SIZE


def tiny_config(**overrides: Any) -> Qwen2Config:
    kw = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
              tie_word_embeddings=False, eos_token_id=EOS_ID, pad_token_id=0)
    kw.update(overrides)
    return Qwen2Config(**kw)


def build_model(seed: int, **config_overrides: Any) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config(**config_overrides)).eval()


def save_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    tokenizer.save_pretrained(path)
    return tokenizer


def save_model_dir(model: Qwen2ForCausalLM, path: Path, *, tokenizer: bool = True) -> str:
    model.save_pretrained(path)
    if tokenizer:
        save_tokenizer(path)
    return str(path)


def save_chat_model(path: Path, seed: int = 0) -> PreTrainedTokenizerFast:
    """A tiny model over the code task's character tokenizer, which has a chat template (tools
    included), saved to `path`; returns the tokenizer."""
    from areal_flow.models.tokenizer import CODE_CHARS, build_char_tokenizer

    tokenizer = build_char_tokenizer(CODE_CHARS, chat=True)
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return tokenizer


def load_reference(path: str) -> Qwen2ForCausalLM:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def greedy_reference(model: torch.nn.Module, prompt: list[int], max_new_tokens: int,
                     stop_ids: tuple[int, ...] = (EOS_ID,)) -> list[int]:
    """Argmax decoding with a full forward per token: no KV cache, no padding, no batching."""
    seq, out = list(prompt), []
    for _ in range(max_new_tokens):
        token = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(token)
        out.append(token)
        if token in stop_ids:
            break
    return out


@torch.no_grad()
def full_forward_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int],
                          temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of one forward over prompt + output, at each output token."""
    logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1: -1]
    return logprobs.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def http_call(base_url: str, method: str, path: str, body: bytes | dict | None = None,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """One request on a fresh connection, with `headers` besides its JSON content type; the body
    comes back decoded when it is JSON."""
    parts = urlsplit(base_url)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        raw = response.read()
        answer_headers = {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()
    payload: Any = raw.decode()
    if answer_headers.get("content-type", "").startswith("application/json"):
        payload = json.loads(raw)
    return response.status, answer_headers, payload


def generate_ok(server: GenerationServer, body: dict) -> Any:
    """POST /generate and the decoded answer, which must be a 200."""
    status, _, payload = http_call(server.url, "POST", "/generate", body)
    assert status == 200, payload
    return payload


def two_prompts_together(model_dir: str, **engine_kw: Any) -> dict[str, float]:
    """The engine's stats after prompts of 2 and 5 tokens, admitted together, make 3 tokens each."""
    engine = GenerationEngine(model_dir, max_batch_size=8, **engine_kw)
    try:
        engine.pause()  # queued while paused, both join the batch together
        futures = [engine.submit(ids, max_new_tokens=3, ignore_eos=True) for ids in ([2, 3], [2, 3, 4, 5, 6])]
        engine.continue_generation()
        assert all(len(f.result(timeout=60).output_ids) == 3 for f in futures)
        return engine.stats()
    finally:
        engine.shutdown()


def before_every_forward(engine: GenerationEngine, hook: Callable[..., object]) -> object:
    """Call `hook(module, args)` before every forward of the engine's model, prefill or decode step
    (the decode step does not go through the model's own forward, but every forward embeds its
    token ids [rows, columns] first: args[0])."""
    return engine.model.get_input_embeddings().register_forward_pre_hook(hook)


@contextlib.contextmanager
def running_server(model_dir: str, *, step_delay: float = 0.0, **engine_kw: Any) -> Iterator[GenerationServer]:
    """A real server on a free port, stopped on exit. `step_delay` seconds of real sleep before every
    forward keep requests decoding long enough for a test to act while they run."""
    server, thread = serve(model_dir, **engine_kw)
    if step_delay:
        before_every_forward(server.engine, lambda *_: time.sleep(step_delay))
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=10)
    assert not thread.is_alive()


@contextlib.contextmanager
def server_process(model_dir: str, *args: str) -> Iterator[tuple[subprocess.Popen, str, list[str]]]:
    """The embedded server's CLI as a real subprocess on `model_dir` with `args`: yields (process,
    its URL once /health answers, its stderr lines so far); stopped (SIGTERM, then SIGKILL) after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_flow.generation.server", "--model-path", model_dir, "--port", "0", *args],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []
    # Drain stderr on a thread so the child never blocks on a full pipe.
    threading.Thread(target=lambda: [(lines.put(line), log.append(line)) for line in proc.stderr], daemon=True).start()
    try:
        url, deadline = None, time.monotonic() + 60
        while url is None:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:  # say why, with what the server wrote: a bare Empty tells nothing
                assert proc.poll() is None, f"the server exited ({proc.returncode}) before serving:\n{''.join(log)[-4000:]}"
                assert time.monotonic() < deadline, f"the server did not serve within 60 s:\n{''.join(log)[-4000:]}"
                continue
            if match := re.search(r"serving .* at (http://\S+)", line):
                url = match.group(1)
        wait_healthy(url, timeout=30)  # /health needs no API key
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


async def async_wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


EOS_PROMPT = [3, 4, 5]


@dataclass(frozen=True)
class ModelDirs:
    a: str
    """The served model (seed 0, eos 1), with a tokenizer."""
    b: str
    """Same architecture, other weights (seed 1): the target of weight updates."""
    wide: str
    """Another architecture (hidden 64): weights that must be refused."""
    eos: str
    """Model a's weights with eos set to a token that greedy decoding of EOS_PROMPT reaches."""
    eos_token: int
    eos_index: int
    """Where that token first appears in the greedy output of EOS_PROMPT."""


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_model_dirs(root: Path) -> ModelDirs:
    model_a = build_model(seed=0)
    a = save_model_dir(model_a, root / "a")
    b = save_model_dir(build_model(seed=1), root / "b")
    wide = save_model_dir(build_model(seed=2, hidden_size=64, intermediate_size=128), root / "wide")
    # Random weights rarely emit id 1, so the eos test gets an eos that greedy decoding does reach.
    free_run = greedy_reference(model_a, EOS_PROMPT, 30, stop_ids=())
    index = next(i for i in range(2, len(free_run)) if free_run[i] not in free_run[:i] and free_run[i] != EOS_ID)
    model_a.config.eos_token_id = model_a.generation_config.eos_token_id = free_run[index]
    eos = save_model_dir(model_a, root / "eos")
    return ModelDirs(a, b, wide, eos, free_run[index], index)
