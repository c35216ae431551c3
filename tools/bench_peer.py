"""areal_flow against TRL's `GRPOTrainer`, side by side, as a new user would run each: on tiny_arith
(`--task tiny_arith`, the default) or on tiny_code (`--task tiny_code`, the recipe code_tiny).

Both start from the same supervised bootstrap (the recipe's own), train on the same problems for
the same wall-time budget with the same batch (8 prompts x 8 answers, lr 1e-4 constant,
temperature 1, no KL, one optimizer step per batch) and the same reward function (tiny_code: the
project's code reward, each program in the code sandbox with the recipe's limits and partial-credit
setting), and save checkpoints along the way; one greedy evaluator (`transformers` `generate`) then
scores every checkpoint of both on the same held-out problems (tiny_code: pass@1 on all 8 tests of a
problem, 5 of them never shown, as the recipe's own held-out figure). Prints trained samples/s,
accuracy over time, the time each needs to reach the peer's final accuracy, the reward's seconds a
sample on each side and the ratios; plots both learning curves in one figure.

    pip install -e '.[bench]'            # trl, accelerate (torch stays 2.13.0)
    python tools/bench_peer.py [--task tiny_arith|tiny_code] [--budget S] [--eval-n N] [--out DIR [--reuse]]
                               [--peer-from DIR] [-- extra areal_flow overrides]

TRL runs in a child process with both cores (its generation and training alternate); areal_flow
runs its recipe (generation on core 0, training on core 1). TRL's settings beyond the shared ones
are its defaults, except gradient checkpointing, which is off: it only costs time at this size.
The held-out problems are the first `--eval-n` of the task's held-out sequence; the training
problems of both sides exclude all of them. Each side's scores are kept in its run folder
(`scores.json`), so `--reuse` (read the runs and scores an earlier call left in `--out`) and
`--peer-from` (TRL's run of an earlier `--out`, to compare areal_flow settings against one peer
run) score nothing twice.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import yaml
from _bench import machine, read_run_dir, run_recipe, save_plot

GROUP, PROMPTS, LR = 8, 8, 1e-4
N_TRAIN, DATA_SEED, BOOTSTRAP_STEPS = 20000, 0, 250  # tiny_arith's; tiny_code's come from its recipe


@dataclass(frozen=True)
class Task:
    """What differs between the tasks."""

    recipe: str
    max_new: int
    """the answer budget, tokens (the recipe's max_new_tokens)."""
    budget: float
    """default training seconds of each side (the recipe's max_wall_seconds, tiny_arith 540)."""
    eval_n: int
    """default held-out problems."""
    steps_per_s: float
    """areal_flow's usual steps/s, to space its kept versions like TRL's checkpoints."""
    score: str
    """what the evaluator's figure is, for the report and plot."""


TASKS = {"tiny_arith": Task("tiny_arith", 96, 540.0, 1000, 1.0, "accuracy"),
         "tiny_code": Task("code_tiny", 128, 600.0, 200, 0.2, "pass@1")}


def recipe_config(task: str, cache_dir: str, eval_n: int):
    """The recipe's typed config, composed as the launcher would (its model, data and sandbox)."""
    from hydra import compose, initialize_config_dir

    from areal_flow.launch import CONF_DIR
    from areal_flow.runtime.spec import typed

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        raw = compose("config", overrides=[f"recipe={TASKS[task].recipe}", f"cache_dir={cache_dir}",
                                           "output_dir=/tmp/unused", f"dataset.n_eval={eval_n}"])
    return typed(raw)


def reward_function(task: str, cache_dir: str, eval_n: int):
    """(completion, row) -> reward in [0, 1]: the task's own reward, as the recipe scores it."""
    if task == "tiny_arith":
        from areal_flow.data.arith import arith_reward

        return lambda completion, row: arith_reward(completion, row["answer"])
    from areal_flow.rewards.code import CodeReward

    code = CodeReward(recipe_config(task, cache_dir, eval_n).sandbox)
    return lambda completion, row: code(completion, json.dumps(row["input_output"]))["reward"]


def task_inputs(task: str, cache_dir: str, eval_n: int) -> tuple[str, str, str]:
    """(base model directory, training file, held-out file), made once in the cache."""
    if task == "tiny_arith":
        from areal_flow.data.arith import ensure_arith_data
        from areal_flow.models.bootstrap import ensure_base_model

        base = ensure_base_model(os.path.join(cache_dir, "models"), steps=BOOTSTRAP_STEPS)
        return (base, *ensure_arith_data(os.path.join(cache_dir, "data"), N_TRAIN, eval_n, DATA_SEED))
    from areal_flow.data.loading import dataset_paths
    from areal_flow.run.prepare import prepare_model

    cfg = recipe_config(task, cache_dir, eval_n)
    return (prepare_model(cfg), *dataset_paths(cfg.dataset, cfg.cache_dir))


@dataclass
class Curve:
    """One side's run: checkpoints as (training seconds, directory), and its throughput."""

    name: str
    checkpoints: list[tuple[float, str]]
    samples: int
    """answers trained on."""
    seconds: float
    generated: int | None = None
    """answers generated and scored (dynamic filtering trains only some of them); None: = samples."""
    no_gradient: float | None = None
    """share of the generated groups whose answers all scored alike (GRPO advantages all 0, no
    gradient); None where the run does not say."""
    reward_seconds: float | None = None
    """seconds the reward function ran a sample (areal_flow: its reward workers' busy time)."""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def generated_per_s(self) -> float:
        return (self.samples if self.generated is None else self.generated) / self.seconds

    @property
    def with_gradient_per_s(self) -> float | None:
        """Generated answers per second in groups whose rewards differ: what teaches the policy."""
        return None if self.no_gradient is None else self.generated_per_s * (1 - self.no_gradient)


def accuracy_at(points: list[tuple[float, float]], t: float) -> float:
    """Accuracy of the last checkpoint saved at or before `t` seconds (`points` sorted by time)."""
    before = [acc for when, acc in points if when <= t + 1e-9]
    if not before:
        raise ValueError(f"no checkpoint at or before {t:.0f} s")
    return before[-1]


def time_to_reach(points: list[tuple[float, float]], target: float) -> float | None:
    """Seconds until the first checkpoint scoring at least `target`; None if none does."""
    return next((when for when, acc in points if acc >= target - 1e-12), None)


def late_mean(points: list[tuple[float, float]], budget: float) -> float:
    """Mean accuracy of the checkpoints saved in the second half of the budget: on this task a
    single checkpoint moves by up to 10 points from its neighbours, their mean by much less."""
    late = [acc for when, acc in points if when >= budget / 2 - 1e-9]
    if not late:
        raise ValueError(f"no checkpoint at or after {budget / 2:.0f} s")
    return sum(late) / len(late)


# ---- TRL, in its own process ------------------------------------------------------------------

def run_trl(task: str, out: str, base: str, train_file: str, budget: float, save_every: float, seed: int,
            cache_dir: str, eval_n: int) -> None:
    """GRPOTrainer for `budget` seconds of training, a checkpoint every `save_every` seconds."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_flow.models.tokenizer import load_tokenizer

    torch.set_num_threads(2)
    with open(train_file) as f:
        rows = [json.loads(line) for line in f]
    # The row's reference as JSON text: Arrow wants one type per column, and tests mix them.
    dataset = Dataset.from_list([{"prompt": r["prompt"], "row": json.dumps(r)} for r in rows])
    reward_of = reward_function(task, cache_dir, eval_n)
    spent = {"seconds": 0.0, "samples": 0}

    def reward(completions, row, **_):
        t0 = time.perf_counter()
        scores = [reward_of(c, json.loads(r)) for c, r in zip(completions, row)]
        spent["seconds"] += time.perf_counter() - t0
        spent["samples"] += len(scores)
        return scores

    class Budget(TrainerCallback):
        """Training seconds exclude the checkpoint saves; stop once the budget is spent."""

        def __init__(self):
            self.start, self.paused, self.next_save, self.saved = 0.0, 0.0, save_every, []

        def elapsed(self) -> float:
            return time.monotonic() - self.start - self.paused

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.monotonic()

        def on_step_end(self, args, state, control, model=None, **kw):
            t = self.elapsed()
            if t >= self.next_save or t >= budget:
                t0 = time.monotonic()
                path = os.path.join(out, f"step{state.global_step}")
                model.save_pretrained(path)
                self.saved.append((t, path, state.global_step))
                self.next_save += save_every
                self.paused += time.monotonic() - t0
            if t >= budget:
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=GROUP * PROMPTS, num_generations=GROUP,
        max_completion_length=TASKS[task].max_new, temperature=1.0, learning_rate=LR, lr_scheduler_type="constant",
        beta=0.0, gradient_checkpointing=False, use_cpu=True, bf16=False, save_strategy="no",
        report_to="none", logging_steps=20, max_steps=10**6, seed=seed)
    budget_cb = Budget()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(base), reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=load_tokenizer(base), callbacks=[budget_cb])
    trainer.train()
    t, _, steps = budget_cb.saved[-1]
    # TRL logs the share of groups whose rewards have zero spread, averaged over each logging window.
    zero_std = [h["frac_reward_zero_std"] for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"checkpoints": [[when, path] for when, path, _ in budget_cb.saved],
                   "samples": steps * GROUP * PROMPTS, "seconds": t,
                   "no_gradient": sum(zero_std) / len(zero_std) if zero_std else None,
                   "reward_seconds": spent["seconds"] / max(spent["samples"], 1)}, f)


def trl_curve(task: str, out: str, base: str, train_file: str, budget: float, save_every: float, seed: int,
              cache_dir: str, eval_n: int, reuse: bool = False) -> Curve:
    if not (reuse and os.path.isfile(os.path.join(out, "result.json"))):
        cmd = [sys.executable, __file__, "_trl", task, out, base, train_file, str(budget), str(save_every), str(seed),
               cache_dir, str(eval_n)]
        print("$ tools/bench_peer.py _trl ...  (TRL GRPOTrainer)", flush=True)
        subprocess.run(cmd, check=True)
    return read_trl(out)


def read_trl(out: str) -> Curve:
    """A finished TRL run of this tool (its result.json)."""
    if not os.path.isfile(os.path.join(out, "result.json")):
        raise SystemExit(f"{out!r} holds no finished TRL run of bench_peer (no result.json)")
    with open(os.path.join(out, "result.json")) as f:
        r = json.load(f)
    return Curve("TRL", [tuple(c) for c in r["checkpoints"]], r["samples"], r["seconds"], no_gradient=r.get("no_gradient"),
                 reward_seconds=r.get("reward_seconds"))


# ---- areal_flow --------------------------------------------------------------------------------

def areal_curve(task: str, out: str, base: str, eval_file: str, eval_n: int, budget: float, keep_every: int, seed: int,
                overrides: list[str], reuse: bool = False) -> tuple[Curve, float | None]:
    """The recipe for `budget` seconds, keeping every `keep_every`-th published version; also
    returns the run's own end-of-run accuracy on the same held-out file (its engine, greedy)."""
    if reuse and os.path.isfile(os.path.join(out, "summary.json")):
        print(f"reusing {out}", flush=True)
        _, metrics = read_run_dir(out)
    else:
        # The budget alone ends the run: the recipe's total_steps (1000) is reached first at 2 steps/s.
        _, metrics = run_recipe(out, [
            f"recipe={TASKS[task].recipe}", f"model.path={base}", f"max_wall_seconds={budget}", "total_steps=1000000",
            f"seed={seed}", f"dataset.n_eval={eval_n}", f"dataset.eval_path={eval_file}", "eval_at_start=false",
            "eval.every_versions=0", "eval_at_end=true", f"rollout.keep_weights_every={keep_every}", "metrics.plot=false",
            *overrides])
    steps = {m["step"]: m for m in metrics if m["event"] == "step"}  # step N published version N
    weights = os.path.join(out, "weights")
    versions = (int(n[1:]) for n in os.listdir(weights) if n.startswith("v") and n[1:].isdigit())
    checkpoints = sorted((steps[v]["elapsed"], os.path.join(weights, f"v{v}")) for v in versions if v in steps)
    last = steps[max(steps)]
    samples = len(steps) * GROUP * PROMPTS
    filtered = sum(m.get("filtered_groups", 0) for m in steps.values())
    with open(os.path.join(out, "config.yaml")) as f:
        bounds = (yaml.safe_load(f).get("algorithm") or {}).get("success_rate_range")
    # Filtering to exactly the groups whose answers do not all score alike makes the filtered share
    # the share without a gradient; other bounds filter some groups that have one.
    exact = bounds is not None and 0 < bounds[0] <= 1 / GROUP and 1 - 1 / GROUP <= bounds[1] < 1
    own = [m["accuracy"] for m in metrics if m["event"] == "eval"]
    spent = [m["reward/reward_seconds"] for m in steps.values() if m.get("reward/reward_seconds") is not None]
    curve = Curve("areal_flow", checkpoints, samples, last["elapsed"], generated=samples + filtered * GROUP,
                  no_gradient=filtered / (filtered + len(steps) * PROMPTS) if exact else None,
                  reward_seconds=sum(spent) / len(spent) if spent else None)
    return curve, own[-1] if own else None


# ---- one evaluator for both ----------------------------------------------------------------------

def score(curves: list[tuple[Curve, str]], base: str, rows: list[dict], task: str, cache_dir: str
          ) -> dict[str, list[tuple[float, float]]]:
    """Greedy accuracy of the start and of every checkpoint, by side: [(seconds, accuracy)]. Each
    side's scores are kept in its run folder (`scores.json`: by checkpoint folder name, "start"
    for the start checkpoint, and the number of problems) and read from there when present."""
    from rich.progress import Progress

    kept = {run_dir: _read_json(os.path.join(run_dir, "scores.json")) for _, run_dir in curves}
    start_key = f"start@{len(rows)}"
    start = next((k[start_key] for k in kept.values() if start_key in k), None)
    evaluate = None

    def accuracy(path: str) -> float:
        nonlocal evaluate
        evaluate = evaluate or _evaluator(base, rows, task, cache_dir)
        return evaluate(path)

    out = {}
    with Progress() as progress:
        bar = progress.add_task("scoring checkpoints", total=1 + sum(len(c.checkpoints) for c, _ in curves))
        start = accuracy(base) if start is None else start
        progress.advance(bar)
        for c, run_dir in curves:
            scores = kept[run_dir]
            scores[start_key] = start
            out[c.name] = [(0.0, start)]
            for t, path in c.checkpoints:
                key = f"{os.path.basename(path)}@{len(rows)}"
                if key not in scores:
                    scores[key] = accuracy(path)
                out[c.name].append((t, scores[key]))
                with open(os.path.join(run_dir, "scores.json"), "w") as f:  # after each: an interrupted call loses one
                    json.dump(scores, f)
                progress.advance(bar)
    return out


def _read_json(path: str) -> dict:
    """A JSON file's mapping; {} where there is none yet."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _evaluator(base: str, rows: list[dict], task: str, cache_dir: str):
    """path -> greedy accuracy on `rows` (transformers generate, the same for both sides)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from areal_flow.models.supervised import greedy_completions
    from areal_flow.models.tokenizer import load_tokenizer

    torch.set_num_threads(2)
    hf_logging.disable_progress_bar()  # one bar for all checkpoints, not one per load
    tokenizer = load_tokenizer(base)
    reward_of = reward_function(task, cache_dir, len(rows))

    def accuracy(path: str) -> float:
        model = AutoModelForCausalLM.from_pretrained(path)
        texts = greedy_completions(model, tokenizer, [r["prompt"] for r in rows], TASKS[task].max_new)
        return sum(reward_of(t, r) for t, r in zip(texts, rows)) / len(rows)

    return accuracy


def report(peer: Curve, ours: Curve, points: dict, budget: float, own_final: float | None, args) -> str:
    p, o = points[peer.name], points[ours.name]
    target = p[-1][1]
    reach = time_to_reach(o, target)
    marks = [t for t in (budget / 4, budget / 2) if t <= min(peer.seconds, ours.seconds) + 1e-9]
    lines = [f"machine: {machine()}",
             f"command: python tools/bench_peer.py --task {args.task} --budget {args.budget:g} --eval-n {args.eval_n} "
             f"--seed {args.seed}"
             + (f" --peer-from {args.peer_from}" if args.peer_from else "")
             + (f" -- {' '.join(args.overrides)}" if args.overrides else ""),
             f"held-out: {args.eval_n} problems, greedy, one evaluator (transformers generate) for both; "
             f"the figure: {TASKS[args.task].score}", "",
             f"| | {peer.name} 1.16 GRPOTrainer (sync) | {ours.name} | ratio |", "|---|---|---|---|",
             f"| generated samples/s | {peer.generated_per_s:.1f} | {ours.generated_per_s:.1f} | "
             f"{ours.generated_per_s / peer.generated_per_s:.2f}× |",
             f"| trained samples/s | {peer.samples_per_s:.1f} | {ours.samples_per_s:.1f} | "
             f"{ours.samples_per_s / peer.samples_per_s:.2f}× |",
             f"| trained samples | {peer.samples} in {peer.seconds:.0f} s | {ours.samples} in {ours.seconds:.0f} s | |",
             f"| accuracy at start | {100 * p[0][1]:.1f}% | {100 * o[0][1]:.1f}% | |"]
    if peer.no_gradient is not None and ours.no_gradient is not None:
        lines[-1:-1] = [
            f"| generated groups whose answers all score alike (no gradient) | {100 * peer.no_gradient:.0f}% | "
            f"{100 * ours.no_gradient:.0f}% (filtered) | |",
            f"| generated samples/s in groups with a gradient | {peer.with_gradient_per_s:.1f} | "
            f"{ours.with_gradient_per_s:.1f} | {ours.with_gradient_per_s / peer.with_gradient_per_s:.2f}× |"]
    if peer.reward_seconds is not None and ours.reward_seconds is not None:
        lines.append(f"| reward's seconds a sample | {1000 * peer.reward_seconds:.1f} ms | "
                     f"{1000 * ours.reward_seconds:.1f} ms (a worker's) | "
                     f"{ours.reward_seconds / peer.reward_seconds:.2f}× |")
    for t in marks:
        a, b = accuracy_at(p, t), accuracy_at(o, t)
        lines.append(f"| accuracy at {t:.0f} s | {100 * a:.1f}% | {100 * b:.1f}% | {100 * (b - a):+.1f} points |")
    lines.append(f"| accuracy at the end ({peer.seconds:.0f} s, {ours.seconds:.0f} s) | {100 * target:.1f}% | "
                 f"{100 * o[-1][1]:.1f}% | {100 * (o[-1][1] - target):+.1f} points |")
    when = f"{reach:.0f} s" if reach is not None else "not reached"
    ratio = f"{reach / peer.seconds:.2f} of the peer's time" if reach is not None else ""
    lines.append(f"| time to {100 * target:.1f}% (the peer's final) | {peer.seconds:.0f} s | {when} | {ratio} |")
    a, b = late_mean(p, budget), late_mean(o, budget)
    lines.append(f"| mean of the checkpoints from {budget / 2:.0f} s on | {100 * a:.1f}% | {100 * b:.1f}% | "
                 f"{100 * (b - a):+.1f} points |")
    if own_final is not None:
        lines += ["", f"areal_flow's own end-of-run evaluation (its engine, greedy, same file): {100 * own_final:.1f}% "
                  f"(the evaluator: {100 * o[-1][1]:.1f}%)"]
    return "\n".join(lines)


def plot(points: dict, path: str, budget: float, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in points.items():
        ax.plot([t for t, _ in pts], [100 * a for _, a in pts], marker="o", label=name)
    ax.set_xlim(0, budget * 1.02)
    ax.set_xlabel("training seconds (2 cores)")
    ax.set_ylabel(f"held-out greedy {TASKS[task].score}, %")
    ax.set_title(f"{task}: areal_flow vs TRL GRPOTrainer, same start")
    ax.grid(alpha=0.3)
    ax.legend()
    save_plot(fig, path)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_trl":
        task, out, base, train, budget, every, seed, cache_dir, eval_n = sys.argv[2:11]
        run_trl(task, out, base, train, float(budget), float(every), int(seed), cache_dir, int(eval_n))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=list(TASKS), default="tiny_arith")
    ap.add_argument("--budget", type=float, default=None,
                    help="training seconds for each side (default: tiny_arith 540, tiny_code 600)")
    ap.add_argument("--eval-n", type=int, default=None,
                    help="held-out problems both sides are scored on (default: tiny_arith 1000, tiny_code 200)")
    ap.add_argument("--points", type=int, default=12, help="checkpoints along each run")
    ap.add_argument("--areal-steps-per-s", type=float, default=None,
                    help="expected areal_flow steps/s, to space its kept versions like TRL's checkpoints "
                         "(default: tiny_arith 1, tiny_code 0.2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cache-dir", default=os.environ.get("AREAL_FLOW_CACHE", os.path.expanduser("~/.cache/areal_flow")))
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--reuse", action="store_true",
                    help="with --out: read the runs (and scores) an earlier call left there instead of running them again")
    ap.add_argument("--peer-from", metavar="DIR",
                    help="TRL's run (and scores) from an earlier call's --out, instead of running TRL again")
    ap.add_argument("--plot", default=None, help="the figure (default: docs/bench_peer.png, "
                    "docs/bench_peer_code.png for tiny_code)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for the areal_flow run")
    args = ap.parse_args()
    task = TASKS[args.task]
    args.budget = task.budget if args.budget is None else args.budget
    args.eval_n = task.eval_n if args.eval_n is None else args.eval_n
    args.areal_steps_per_s = args.areal_steps_per_s or task.steps_per_s
    args.plot = args.plot or ("docs/bench_peer.png" if args.task == "tiny_arith" else "docs/bench_peer_code.png")
    if args.reuse and not args.out:
        ap.error("--reuse needs --out DIR")
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("bench_peer needs TRL, an optional extra: pip install -e '.[bench]'")

    base, train_file, eval_file = task_inputs(args.task, args.cache_dir, args.eval_n)
    with open(eval_file) as f:
        rows = [json.loads(line) for line in f]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or tmp
        os.makedirs(root, exist_ok=True)
        trl_dir = os.path.join(args.peer_from or root, "trl")
        peer = read_trl(trl_dir) if args.peer_from else trl_curve(
            args.task, trl_dir, base, train_file, args.budget, args.budget / args.points, args.seed, args.cache_dir,
            args.eval_n, args.reuse)
        keep = max(1, round(args.budget * args.areal_steps_per_s / args.points))
        ours_dir = os.path.join(root, "areal_flow")
        ours, own_final = areal_curve(args.task, ours_dir, base, eval_file, args.eval_n, args.budget, keep, args.seed,
                                      args.overrides, args.reuse)
        points = score([(peer, trl_dir), (ours, ours_dir)], base, rows, args.task, args.cache_dir)
    text = report(peer, ours, points, args.budget, own_final, args)
    print("\n" + text)
    print(json.dumps({k: [[round(t, 1), round(a, 4)] for t, a in v] for k, v in points.items()}))
    plot(points, args.plot, args.budget, args.task)


if __name__ == "__main__":
    main()
