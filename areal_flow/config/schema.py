"""The configuration schema: one dataclass per concern, one line of help per field.

Hydra composes `conf/config.yaml` + the chosen recipe + command-line overrides onto `RunConfig`;
OmegaConf rejects unknown keys and wrongly typed values with the full key path. A field's value
range is declared on the field itself (`ge`, `gt`, `le`, `choices`) and checked by one generic
checker (`config/validate.py: check_ranges`); cross-field and machine rules live beside the
launcher (`run/checks.py`), and the graph's rules in `graph/` (`dag.py: build_graph`). Every process receives this typed config (`runtime/spec.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from areal_flow.config.fields import doc
from areal_flow.config.nodes import NODE_CONFIGS, NodeConfig, node_config  # noqa: F401 - NodeConfig: the schema's


@dataclass
class ClusterConfig:
    """The devices a run may place nodes on."""

    device_type: str = doc("cpu", "'cpu' (a device is a core, each process pinned to its mesh's cores) or 'cuda' (a "
                           "device is a GPU, each process sees only its mesh's GPUs)", choices=("cpu", "cuda"))
    n_devices: int = doc(2, "devices on each node that meshes may use; node k holds devices k·n_devices .. "
                         "(k+1)·n_devices-1", ge=1)
    n_nodes: int = doc(1, "nodes (hosts) of the cluster; more than 1 with launcher.type=ray or slurm (or dry_run=true)", ge=1)


@dataclass
class ModelConfig:
    """The actor's starting checkpoint."""

    path: Optional[str] = doc(None, "Hugging Face model dir to start from; null builds and bootstraps the tiny model")
    arch: Dict[str, int] = doc(help="Qwen2 shape overrides for the tiny model (hidden_size, num_hidden_layers, ...)", factory=dict)
    bootstrap_steps: int = doc(250, "supervised bootstrap steps when the base model is built here", ge=0)
    bootstrap_lr: float = doc(3e-3, "learning rate of the supervised bootstrap", gt=0)
    bootstrap_batch_size: int = doc(64, "problems per bootstrap step", ge=1)
    bootstrap_task: Optional[str] = doc(None, "what the tiny model is bootstrapped on: null for dataset.name's own task, "
                                        "'tiny_arith_tool' (arithmetic, the Python tool used some of the time), "
                                        "'tiny_arith_chat_tool' (the same as chat turns, the tool a function call), "
                                        "'tiny_arith_check' (arithmetic, half of it checking claimed sums) or "
                                        "'tiny_code_feedback' (code, some first attempts repaired after a failed test)",
                                        choices=("tiny_arith", "tiny_arith_tool", "tiny_arith_chat_tool",
                                                 "tiny_arith_check", "tiny_code", "tiny_code_feedback"))


@dataclass
class DatasetConfig:
    """Prompts for training and the held-out set."""

    name: str = doc("tiny_arith", "'tiny_arith' or 'tiny_code' (generated into the cache), 'jsonl' (generic rows), "
                    "'areal_math' (AReaL math rows: query_id, prompt, solutions), 'areal_code' (AReaL code rows: "
                    "query_id, prompt, input_output or assert-style tests) or 'humaneval' (areal_code rows to train "
                    "on, HumanEval's 164 problems held out); docs/datasets.md",
                    choices=("tiny_arith", "tiny_code", "jsonl", "areal_math", "areal_code", "humaneval"))
    train_path: Optional[str] = doc(None, "training prompts: a .jsonl file, a .parquet file or a directory saved by "
                                    "datasets (all but tiny_arith and tiny_code; null with sample=true)")
    eval_path: Optional[str] = doc(None, "held-out prompts, as train_path; with tiny_arith (tiny_code), a file of "
                                   "{prompt, answer} (AReaL code) rows that replaces the generated held-out set (e.g. "
                                   "the problems a peer is scored on)")
    sample: bool = doc(False, "areal_math/areal_code: train and evaluate on the small sample set shipped in "
                       "areal_flow/data/samples/ (train_path/eval_path stay null); humaneval: train on the code "
                       "samples")
    train_split: str = doc("train", "split of train_path when it is a saved DatasetDict")
    eval_split: str = doc("test", "split of eval_path when it is a saved DatasetDict")
    fields: List[str] = doc(help="fields every row must have; they become graph keys", factory=lambda: ["prompt", "answer"])
    prompt_template: Optional[str] = doc(None, "format string over a row's fields giving the prompt text, e.g. "
                                         "'Question: {prompt}\\nAnswer:'; null = the prompt field as it is")
    chat_template: bool = doc(False, "wrap the prompt (after prompt_template) in the tokenizer's chat template as one "
                              "user message, with the generation prompt")
    long_prompts: str = doc("refuse", "a prompt whose tokens leave less than algorithm.max_new_tokens of the model's "
                            "context: 'refuse' stops the launch naming its file:line, 'skip' leaves the row out "
                            "(counted once at launch)", choices=("refuse", "skip"))
    n_train: int = doc(20000, "generated training problems (tiny_arith, tiny_code)", ge=1)
    n_eval: int = doc(200, "generated held-out problems (tiny_arith, tiny_code)", ge=1)
    seed: int = doc(0, "seed of the generated data and of the prompt order")


LEVELS = ("group", "batch", "none")


@dataclass
class NormConfig:
    """Centring and scaling of rewards or advantages (AReaL's NormConfig; docs/algorithms.md)."""

    mean_level: str = doc("group", "subtract the mean over the group (answers to one prompt), the batch, or none",
                          choices=LEVELS)
    std_level: str = doc("group", "divide by the std over the group, the batch, or none", choices=LEVELS)
    leave_one_out: bool = doc(False, "the mean of the OTHER answers of the group (RLOO's baseline); needs "
                              "mean_level=group")
    std_unbiased: bool = doc(True, "unbiased std (n − 1); false = biased (n)")
    eps: float = doc(1e-6, "added to the std", ge=0)


def _no_norm() -> NormConfig:
    return NormConfig(mean_level="none", std_level="none")


@dataclass
class AlgorithmConfig:
    """Advantages, the policy loss and KL (docs/algorithms.md); the default is GRPO with the
    decoupled PPO objective, and conf/algorithm/ has the named presets."""

    group_size: int = doc(8, "samples per prompt; advantages are normalised within a group (≥ 2: one sample has advantage 0)",
                          ge=2)
    batch_size: int = doc(8, "prompt groups per train step (B)", ge=1)
    lr: float = doc(1e-4, "actor learning rate (AdamW)", gt=0)
    betas: List[float] = doc(help="AdamW betas", factory=lambda: [0.9, 0.999])
    weight_decay: float = doc(0.0, "AdamW weight decay, on weight matrices only (not biases or norms)", ge=0)
    grad_clip: float = doc(1.0, "gradient norm clip; 0 turns it off", ge=0)
    lr_schedule: str = doc("constant", "LR schedule over optimizer steps: constant | linear | cosine (after warm-up)",
                           choices=("constant", "linear", "cosine"))
    lr_warmup_steps: int = doc(0, "optimizer steps of linear LR warm-up (the first runs at lr/warmup)", ge=0)
    lr_decay_steps: Optional[int] = doc(None, "optimizer steps at which linear/cosine reach lr_min_ratio·lr; "
                                        "null = total_steps × n_minibatches × ppo_epochs", ge=1)
    lr_min_ratio: float = doc(0.0, "final LR of linear/cosine as a fraction of lr", ge=0, le=1)
    max_nan_steps: int = doc(3, "train steps in a row with a non-finite loss (each skipped, counted) before the run stops", ge=1)
    eps_clip: float = doc(0.2, "PPO clip ε (lower side, and upper side unless eps_clip_high is set)", gt=0)
    eps_clip_high: Optional[float] = doc(None, "upper PPO clip ε_high (DAPO clip-higher); null = eps_clip", gt=0)
    c_clip: Optional[float] = doc(None, "dual clip: a token's loss is at most c_clip·|A| (acts where A < 0); null = "
                                  "off", gt=1)
    policy_loss: str = doc("ppo", "ppo (clip; GSPO with importance_level=sequence) | cispo (REINFORCE weighted by the "
                           "clipped, stop-gradient ratio) | 'module:function' of your own (docs/algorithms.md)")
    importance_level: str = doc("token", "the ratio π_θ/π_prox per token, or per sequence as the geometric mean over "
                                "its tokens (GSPO)", choices=("token", "sequence"))
    loss_agg: str = doc("token-mean", "how token losses add up: token-mean (over the global batch's valid tokens) | "
                        "seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (Dr.GRPO: a sequence's "
                        "token sum over a constant length)",
                        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"))
    loss_agg_norm_length: Optional[int] = doc(None, "seq-mean-token-sum-norm's constant length; null = max_new_tokens",
                                              ge=1)
    correction: str = doc("areal", "the off-policy correction of the behaviour weight w = π_prox/π_behav "
                          "(docs/algorithms.md): areal (AReaL: w masked outside [floor, cap]) | tis (truncated IS) | "
                          "mis (masked IS) | icepop (two-sided mask) | m2po (second-moment mask) | mismatch_mask "
                          "(|log w| > τ masked) | vtrace (min(ρ̄, w))",
                          choices=("areal", "tis", "mis", "icepop", "m2po", "mismatch_mask", "vtrace"))
    correction_level: str = doc("token", "tis and mis: the weight per token, or per answer as the product of its "
                                "tokens' weights", choices=("token", "sequence"))
    behav_weight_cap: Optional[float] = doc(None, "the correction's upper bound on w (areal and icepop: masked above; "
                                            "tis: C; mis: C; vtrace: ρ̄); null = its source's (areal 5, tis 2, mis 2, "
                                            "icepop 5, vtrace 1); .inf = none (areal)", ge=1)
    behav_weight_floor: Optional[float] = doc(None, "the lower bound on w (icepop: α, null = 0.5; areal: none unless "
                                              "set)", ge=0)
    correction_tau: Optional[float] = doc(None, "m2po: τ on mean((log w)²) (null = 0.04); mismatch_mask: τ on |log w| in "
                                          "nats (null = ln 2)", ge=0)
    clip_behav: bool = doc(False, "also clip the whole ratio π_θ/π_behav as naive PPO does, besides the decoupled "
                           "objective's clip against π_prox: a stale token the policy moved past the clip since it was "
                           "sampled gets no gradient (not AReaL's objective; ppo loss at token level only)")
    stale_warn_capped: float = doc(0.05, "warn once (console and metrics) when more than this share of a step's tokens "
                                   "has a behaviour weight outside [floor, cap] for stale_warn_steps steps in a row; "
                                   "0 = never", ge=0, le=1)
    stale_warn_ess: float = doc(0.5, "warn likewise when the behaviour weights' effective sample size is below this "
                                "fraction of the tokens; 0 = never", ge=0, le=1)
    stale_warn_steps: int = doc(5, "steps in a row before a staleness warning", ge=1)
    decoupled: bool = doc(True, "the decoupled objective when the train node reads prox_logprobs; false = naive PPO "
                          "against π_behav (the prox node does not run), as the staleness study compares")
    prox_logp: str = doc("recompute", "how π_prox is had when the train node reads prox_logprobs: recompute (the prox "
                         "inference node's forward pass) | loglinear (interpolated between π_behav and π_θ by each "
                         "token's version, AReaL's approximation: no forward pass)",
                         choices=("recompute", "loglinear"))
    prox_shortcut: bool = doc(True, "skip the prox forward pass when it is exact without it: the update is one "
                              "optimizer step (π_prox = π_θ before it), or every token was sampled by the current "
                              "weights (π_prox = π_behav)")
    skip_zero_advantage: bool = doc(True, "run no forward or backward pass for answers whose advantages are all exactly "
                                    "0 (a group whose rewards are all equal, under GRPO) where the loss's gradient "
                                    "is proportional to the advantage: their terms and gradients are 0, so the "
                                    "update is the same; they still count in the loss's denominator")
    reward_norm: NormConfig = doc(help="normalisation of the rewards, per answer (GRPO: group mean and std)",
                                  factory=NormConfig)
    adv_estimator: str = doc("gae", "gae (GAE(γ, λ) on the critic's values, or on 0 without a critic: returns) | "
                             "returns (γ-discounted returns-to-go) | 'module:function' of your own")
    gamma: float = doc(1.0, "discount γ of the token rewards", ge=0, le=1)
    gae_lambda: float = doc(1.0, "GAE's λ", ge=0, le=1)
    adv_norm: NormConfig = doc(help="normalisation of the advantages, over valid tokens (REINFORCE++, PPO: batch)",
                               factory=_no_norm)
    critic_lr: Optional[float] = doc(None, "the critic's learning rate (a critic train node); null = lr", gt=0)
    value_loss: str = doc("mse", "the critic's loss: mse (½(V − R)²) | huber", choices=("mse", "huber"))
    value_clip: Optional[float] = doc(0.2, "clip each value's move from the critic's old value to ±this (PPO's "
                                      "value clipping); null = none", gt=0)
    huber_delta: float = doc(10.0, "value_loss=huber: where the loss turns linear", gt=0)
    reward_shapers: List[str] = doc(help="more reward shapers, by name or 'module:function', applied in order after "
                                    "the overlong penalty", factory=list)
    overlong_tokens: Optional[int] = doc(None, "DAPO's soft overlong penalty: over the last this many tokens before "
                                         "max_new_tokens the reward falls linearly by up to overlong_penalty_factor; "
                                         "null = off", ge=1)
    overlong_penalty_factor: float = doc(1.0, "the overlong penalty at max_new_tokens", ge=0)
    kl_coef: float = doc(0.0, "KL coefficient β toward the ref model (needs a ref inference node); the initial value "
                         "when kl_target is set", ge=0)
    kl_estimator: str = doc("k3", "KL estimator per token, d = log π − log π_ref: k1 = d, k2 = d²/2, k3 = e^−d − 1 + d",
                            choices=("k1", "k2", "k3"))
    kl_clamp: Optional[float] = doc(10.0, "clamp each token's KL estimate to ±this; null = no clamp", gt=0)
    kl_in: str = doc("loss", "loss: β·KL of π_θ is a loss term | reward: −β·KL of π_behav is a per-token reward "
                     "(PPO, REINFORCE++)", choices=("loss", "reward"))
    kl_target: Optional[float] = doc(None, "adaptive β (Ziegler et al.): steer the batch's mean KL toward this; null = "
                                     "fixed β", gt=0)
    kl_horizon: int = doc(10000, "adaptive β: samples over which a 20% KL error changes β by 20%", ge=1)
    success_rate_range: Optional[List[float]] = doc(None, "[low, high]: train only prompt groups whose share of "
                                                    "correct answers (reward ≥ 1) lies within, e.g. [0.05, 0.95] "
                                                    "(dynamic filtering); the rest are dropped, counted, and "
                                                    "replaced by new groups; null = train every group")
    filter_stall_batches: int = doc(10, "stop the run when dynamic filtering drops this many batches' worth of "
                                    "prompt groups in a row, none kept (as veRL DAPO's max_num_gen_batches); "
                                    "0 = never (step_timeout still ends a run that trains nothing)", ge=0)
    mask_truncated: bool = doc(False, "answers cut at max_new_tokens get no loss (AReaL's mask_no_eos_with_zero); false trains them")
    n_minibatches: int = doc(1, "optimizer steps per train batch (the batch is split by groups)", ge=1)
    ppo_epochs: int = doc(1, "passes over each train batch; every pass makes n_minibatches optimizer steps", ge=1)
    temperature: float = doc(1.0, "sampling temperature; trainer logprobs use the same scaling", gt=0)
    max_new_tokens: int = doc(96, "generation budget per sample", ge=1)
    top_p: float = doc(1.0, "nucleus sampling threshold", gt=0, le=1)


@dataclass
class RolloutConfig:
    """How far generation may run ahead of training (docs/architecture.md, "Staleness")."""

    max_staleness: int = doc(4, "η: admit a group only while accepted + running < (η + v + 1)·B; 0 = synchronous", ge=0)
    max_concurrent: int = doc(64, "most prompt groups generating at once", ge=1)
    staleness_shown: Optional[int] = doc(None, "the largest η at which this recipe was shown to end as well as at "
                                         "η = 0 (docs/staleness_study.md); a run with a larger max_staleness warns at "
                                         "start; null = no evidence either way, no warning", ge=0)
    workers: int = doc(1, "rollout worker processes", ge=1)
    interrupt: bool = doc(True, "a weight update interrupts the running requests, which resume under the new "
                          "weights; false: it waits until they finish")
    pause_mode: str = doc("abort", "how an interrupting update stops the running requests: 'abort' (AReaL: they "
                          "return their tokens so far and the rollout worker resubmits them), 'retract' (SGLang: "
                          "the server requeues and recomputes them itself) or 'in_place' (PipelineRL's in-flight "
                          "update: they keep the old weights' KV cache and go on under the new weights, no "
                          "recompute)", choices=("abort", "retract", "in_place"))
    weight_update_mode: str = doc("disk", "how each new version reaches the generation servers (areal_flow/weights/): "
                                  "'disk' (a Hugging Face directory in the run directory), 'shm' (the same files in "
                                  "shared memory, /dev/shm: no disk, one host; removed when the run ends), "
                                  "'distributed' (trainer rank 0 broadcasts them in buckets over a gloo/NCCL group "
                                  "with every server, SGLang's update_weights_from_distributed) or 'ipc' (trainer rank "
                                  "0 hands colocated servers CUDA IPC handles to its own tensors, SGLang's "
                                  "update_weights_from_tensor); distributed and ipc need interrupt=true",
                                  choices=("disk", "shm", "distributed", "ipc"))
    keep_weights_every: int = doc(0, "weight_update_mode=disk: also keep every N-th published version (weights/vN, "
                                  "a Hugging Face directory without the tokenizer), e.g. to score a run's learning "
                                  "curve offline; 0 = keep only the last two", ge=0)
    weight_bucket_mb: int = doc(512, "weight_update_mode=distributed or ipc: most MiB of weights per bucket (one request "
                                "to each server, then one broadcast; a larger tensor travels alone); the trainer "
                                "gathers one bucket at a time, and each server keeps one bucket's memory to "
                                "receive into", ge=1)
    request_timeout: float = doc(600.0, "seconds one request to a generation server may take before it is retried on "
                                 "another", gt=0)
    request_retries: int = doc(3, "retries of a request after a connection error, timeout or 5xx answer (never after "
                               "a 4xx)", ge=0)
    retry_backoff: float = doc(0.5, "seconds before the first retry, doubled for each next one (5 s at most)", ge=0)
    health_interval: float = doc(2.0, "seconds between /health checks of a generation server marked down", gt=0)
    down_timeout: float = doc(60.0, "seconds a request waits for a server to come back when every one is down, "
                              "then fails", ge=0)
    failed_groups_stall: int = doc(64, "stop the run when this many prompt groups in a row fail to generate (an "
                                   "agent's rollout that failed every run, an environment that raised), none scored "
                                   "between them; 0 = never (step_timeout still ends a run that trains nothing)", ge=0)


@dataclass
class GenerationConfig:
    """The generation servers: areal_flow's embedded engine or real SGLang (docs/generation.md, "Real SGLang")."""

    backend: str = doc("embedded", "embedded: areal_flow's engine (any machine); sglang: `python -m sglang.launch_server` "
                       "(pip install -e '.[sglang]')", choices=("embedded", "sglang"))
    host: str = doc("127.0.0.1", "address the servers bind (--host); clients connect to it, or to loopback when it is "
                    "0.0.0.0 or ::")
    tp_size: int = doc(1, "devices per server: the generate mesh runs len(mesh)/tp_size servers; sglang: --tp-size, "
                       "embedded: the server's torch threads", ge=1)
    max_batch_size: Optional[int] = doc(None, "most requests a server decodes at once; null = 128 (embedded), "
                                        "SGLang's own choice (sglang: --max-running-requests)", ge=1)
    max_total_tokens: Optional[int] = doc(None, "KV cache budget of a server in tokens; requests wait while the blocks "
                                          "they need now are taken, and the newest are retracted when the running "
                                          "ones outgrow it (embedded); null = no budget (embedded), SGLang's choice "
                                          "(sglang: --max-total-tokens)", ge=1)
    mem_fraction_static: Optional[float] = doc(None, "share of the GPU's memory for the server's weights and KV cache "
                                               "(sglang: --mem-fraction-static); embedded on cuda: sets the KV budget "
                                               "when max_total_tokens is null; null = SGLang's choice, or no budget",
                                               gt=0, le=1)
    context_length: Optional[int] = doc(None, "sglang: --context-length; null = the model's config.json", ge=1)
    dtype: Optional[str] = doc(None, "number format of the servers' weights, activations and KV cache (sglang: "
                               "--dtype); null or auto = bfloat16 on cuda, float32 on cpu (sglang: its 'auto')",
                               choices=("auto", "half", "float16", "bfloat16", "float", "float32"))
    attention_backend: Optional[str] = doc(None, "sglang: --attention-backend (e.g. fa3, flashinfer, triton, "
                                           "intel_amx on CPU); null = SGLang's choice")
    chunked_prefill_size: Optional[int] = doc(None, "prompt tokens prefilled per forward beside the decoding rows "
                                              "(--chunked-prefill-size); -1 turns chunked prefill off (AReaL's "
                                              "default); null = whole prompts (embedded), SGLang's choice", ge=-1)
    page_size: Optional[int] = doc(None, "tokens per block of the paged KV cache (--page-size); null = 16 (embedded), "
                                   "SGLang's choice", ge=1)
    disable_cuda_graph: bool = doc(False, "run decode steps eagerly instead of replaying CUDA graphs "
                                   "(--disable-cuda-graph); embedded: graphs only on cuda")
    disable_overlap_schedule: bool = doc(False, "read each step's sampled tokens back before launching the next "
                                         "forward (--disable-overlap-schedule); by default the host schedules the "
                                         "next step while the device computes this one")
    lora_decode: str = doc("lowrank", "embedded, with training.lora: lowrank adds each adapter's low-rank path to its "
                           "projection at decode (an update copies the adapters alone); merge merges them into the "
                           "weights in fp32 (docs/lora.md measures both)", choices=("lowrank", "merge"))
    disable_radix_cache: bool = doc(False, "keep no prefix cache (--disable-radix-cache): every request, a later "
                                    "turn's too, prefills its whole prompt; embedded: the cache is off anyway under "
                                    "deterministic decoding")
    deterministic: Optional[bool] = doc(None, "embedded: batch-invariant decoding (--enable-deterministic-inference): a "
                                        "request's tokens and logprobs do not depend on what it is batched with, "
                                        "about 20% fewer tokens/s; null = on at rollout.max_staleness=0, where it "
                                        "makes seeded runs reproducible bit for bit (sglang: add the flag to extra_args)")
    max_request_bytes: int = doc(16 << 20, "embedded: larger request bodies are refused (413) before they are read "
                                 "or tokenized (--max-request-bytes); 16 MiB holds a 128k-token conversation many "
                                 "times over", ge=1)
    tool_call_parser: str = doc("auto", "the format of the policy's tool calls in chat answers (--tool-call-parser, "
                                "SGLang's names): hermes (Qwen2.5/Qwen3, Hermes), llama3 (Llama 3.x JSON), mistral, "
                                "pythonic (Llama 3.2/4 pythonic); qwen25, qwen, llama3_json, llama4_pythonic are "
                                "aliases; auto = the one the model's chat template writes (docs/generation.md)",
                                choices=("auto", "hermes", "llama3", "mistral", "pythonic", "qwen25", "qwen",
                                         "llama3_json", "llama4_pythonic"))
    extra_args: List[str] = doc(help="sglang: more launch_server arguments, passed verbatim, e.g. "
                                "['--log-level', 'warning']; a flag a key above sets is refused", factory=list)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """Low-rank adapters on the trained model (training/lora.py, through peft; docs/lora.md)."""

    rank: int = doc(0, "the adapters' rank r; 0 = no LoRA, every weight trains", ge=0)
    alpha: float = doc(16.0, "the adapters' output is scaled by alpha / rank (alpha / √rank with rslora)", gt=0)
    dropout: float = doc(0.0, "dropout on an adapter's input in the train step's forward (not in logprobs: π_prox "
                         "and the reported logprobs stay deterministic)", ge=0, le=0.9)
    target_modules: List[str] = doc(help="the Linear layers adapted, by name (every layer whose name ends with one)",
                                    factory=lambda: list(LORA_TARGETS))
    target_regex: Optional[str] = doc(None, "instead of target_modules: a regex that a module's full name must match "
                                      "(peft's), e.g. '.*layers\\.[0-3]\\..*(q|v)_proj'")
    init: str = doc("default", "peft's init_lora_weights: default (B = 0, A Kaiming-uniform: training starts at the "
                    "base model) | gaussian", choices=("default", "gaussian"))
    rslora: bool = doc(False, "rank-stabilised scaling alpha / √rank instead of alpha / rank")


@dataclass
class TrainingConfig:
    """How the trainer ranks compute (engines: graph nodes' `engine`; number formats: runtime/devices.py)."""

    dtype: str = doc("auto", "compute dtype of forward and backward (autocast, FSDP2's param_dtype); master weights, "
                     "optimizer state and gradient reductions stay float32 and the loss's logprobs are float32; "
                     "auto = bfloat16 on cuda, float32 on cpu", choices=("auto", "float32", "bfloat16"))
    activation_checkpointing: bool = doc(False, "recompute each decoder layer's activations in backward instead "
                                         "of keeping them (less GPU memory, about a third more compute); megatron: "
                                         "its full, uniform recomputation")
    attention: str = doc("auto", "attention over packed sequences: varlen (flash kernel over cu_seqlens, CUDA), "
                         "flex (FlexAttention, document-causal block mask), sdpa (transformers' dense block mask; "
                         "the reference); auto = the fastest this device has", choices=("auto", "varlen", "flex", "sdpa"))
    logprob_chunk_tokens: int = doc(1024, "tokens whose logits are computed at once for logprobs and entropy, so "
                                    "that no [tokens, vocab] float32 logits are held; 0 = a micro-batch at once", ge=0)
    entropy: bool = doc(True, "compute each trained token's entropy alongside its logprob (chunked, no extra "
                        "logits held) and log it as train/entropy_sum (divide by train/n_tokens for the mean)")
    distributed_optimizer: bool = doc(False, "megatron engine: shard the optimizer state over data-parallel ranks "
                                      "(megatron's DistributedOptimizer)")
    sequence_parallel: bool = doc(False, "megatron engine, tp > 1: split the activations outside attention and MLP "
                                  "over the tensor-parallel ranks along the sequence (less memory)")
    lora: LoraConfig = doc(help="train low-rank adapters instead of every weight (rank 0: off)", factory=LoraConfig)
    zero_mismatch: bool = doc(False, "compute π_prox as the servers computed π_behav (their own batch-invariant forward, "
                              "decode step by decode step, on a copy of the weights), so that a token the current "
                              "weights sampled has log π_prox = log π_behav bit for bit; needs generation.deterministic "
                              "and the embedded engine; costs a decode step per answer token (docs/algorithms.md)")


@dataclass
class SandboxConfig:
    """How `code` reward nodes run the programs a model writes (docs/rewards.md)."""

    backend: str = doc("local", "local: this machine's sandbox (namespaces, chroot, own uid, limits); remote: "
                       "a SandboxFusion-style service (POST {url}/run_code)", choices=("local", "remote"))
    url: Optional[str] = doc(None, "remote backend: the service's base URL, e.g. http://sandbox:8080")
    wall_seconds: float = doc(6.0, "wall-clock seconds per test case", gt=0)
    cpu_seconds: int = doc(6, "CPU seconds per test case (RLIMIT_CPU)", ge=1)
    memory_mb: int = doc(1024, "address space of a program in MiB (RLIMIT_AS)", ge=64)
    file_size_mb: int = doc(16, "largest file a program may write, MiB (RLIMIT_FSIZE)", ge=1)
    disk_mb: int = doc(64, "size of each of the program's tmpfs /sandbox and /tmp, MiB", ge=1)
    processes: int = doc(32, "processes and threads a program may have (RLIMIT_NPROC of its own uid)", ge=1)
    open_files: int = doc(64, "open files of a program (RLIMIT_NOFILE)", ge=16)
    output_bytes: int = doc(1 << 20, "more stdout or stderr than this stops a test case", ge=1024)
    fail_fast: bool = doc(True, "stop a program's tests at the first that crashes or times out (the rest: not_run)")
    partial_credit: bool = doc(False, "the code reward is the fraction of a program's tests that pass, not 1 only "
                               "when all pass (tests not run count as failed: see fail_fast)")
    allow_unsandboxed: bool = doc(False, "run programs without namespaces where the machine cannot make them: "
                                  "UNSAFE, they reach the network and every world-readable file")
    python: Optional[str] = doc(None, "interpreter of the programs; null = the one running areal_flow")


@dataclass
class LauncherConfig:
    """How processes are started and watched."""

    type: str = doc("local", "'local': one OS process per role on this machine; 'ray': each process on its node of a "
                    "Ray cluster, placed by placement groups (pip install -e '.[ray]'); 'slurm': an sbatch job of "
                    "cluster.n_nodes nodes, one srun step per process (docs/clusters.md)",
                    choices=("local", "ray", "slurm"))
    ray_address: str = doc("auto", "launcher.type=ray: the cluster to join (`ray start --head` prints it); 'auto' "
                           "finds the one this host belongs to")
    slurm_partition: Optional[str] = doc(None, "launcher.type=slurm: the partition to submit to (#SBATCH "
                                         "--partition); none: the cluster's default")
    slurm_account: Optional[str] = doc(None, "launcher.type=slurm: the account charged (#SBATCH --account); none: "
                                       "your default account")
    slurm_time: Optional[str] = doc(None, "launcher.type=slurm: the job's time limit, as sbatch takes it "
                                    "('4:00:00', '2-00:00:00'); none: the partition's default")
    slurm_extra: List[str] = doc(help="launcher.type=slurm: more #SBATCH lines, each without the prefix, e.g. "
                                 "['--qos=high', '--constraint=h100']", factory=list)
    slurm_base_port: int = doc(29600, "launcher.type=slurm: the first of the fixed TCP ports the run's servers "
                               "listen on (one per listening process, counted up from here)", ge=1024, le=65000)
    slurm_stop_before: int = doc(120, "launcher.type=slurm: seconds before the job's time limit that Slurm signals "
                                 "the job script (#SBATCH --signal=B:USR1@N; Slurm may signal up to 60 s early), which "
                                 "stops the run with a checkpoint that resume=auto continues; 0: no signal", ge=0)
    pin_cpus: bool = doc(True, "on CPU, pin each process to the cores of its mesh")
    start_timeout: float = doc(120.0, "seconds a process may take to come up before the run fails", gt=0)
    stop_timeout: float = doc(10.0, "seconds between SIGTERM and SIGKILL when stopping children", ge=0)
    secure: bool = doc(False, "bind to the host's address with a per-run secret (ZeroMQ CURVE, an HTTP API token) "
                       "even on one host; on automatically when the placement spans hosts (docs/security.md)")


@dataclass
class CheckpointConfig:
    """Resumable checkpoints in RUN_DIR/checkpoints/ (docs/reliability.md)."""

    every_steps: int = doc(0, "save one every N train steps (0 = not by steps); one is also saved at the end of the "
                           "run and when the launcher is stopped (SIGTERM, Ctrl-C)", ge=0)
    every_minutes: float = doc(0.0, "save one when this many minutes of training have passed since the last "
                               "(0 = not by time)", ge=0)
    keep_last: int = doc(2, "complete checkpoints kept; older ones are removed once a newer one is complete", ge=1)
    at_stop: bool = doc(True, "save one when the launcher is stopped (SIGTERM, SIGINT) before it stops the processes")
    stop_timeout: float = doc(600.0, "seconds a stopped launcher waits for that checkpoint (the current step ends "
                              "first) before it stops every process without one", ge=0)


@dataclass
class RecoverConfig:
    """What the launcher does when a process of the run dies."""

    retries: int = doc(0, "restart the whole run from its last checkpoint this many times after a process dies "
                       "that is not restarted alone; 0 = the run fails", ge=0)
    worker_restarts: int = doc(3, "restart a generation server (weight_update_mode disk or shm), "
                               "rollout worker, reward worker or inference process that dies, alone, this many times each, while the "
                               "run goes on; 0 = its death is the run's", ge=0)
    infer_rerequest_seconds: float = doc(20.0, "a trainer rank asks an inference process (a node on a mesh of its own) "
                                         "again for a group's result it has waited for this long: the process may have "
                                         "died with the request and been restarted", gt=0)


@dataclass
class ElasticConfig:
    """The autoscaler of the policy's generation servers (docs/reliability.md, "Elastic"); `python -m
    areal_flow.scale` changes a live run by hand."""

    auto: bool = doc(False, "add and remove the policy's generation servers from the run's own figures while it "
                     "runs (local launcher); every decision is logged with them in RUN_DIR/scale/decisions.jsonl")
    window_steps: int = doc(5, "decide from the last this many steps' metrics, and wait this many steps after a change "
                            "before deciding again", ge=1)
    add_above_trainer_idle: float = doc(0.3, "add a server when the trainer waited on samples (trainer_idle) more than "
                                        "this share of each of the window's steps and a device is free", ge=0, le=1)
    remove_above_generator_idle: float = doc(0.5, "remove one when the servers idled (generator_idle: the staleness "
                                             "bound held generation back) more than this share of each of the "
                                             "window's steps while the trainer did not wait", ge=0, le=1)
    max_servers: int = doc(0, "never more generation servers than this; 0 = as many as the free devices allow", ge=0)


METRICS_BACKENDS = ("jsonl", "tensorboard", "wandb")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class WandbConfig:
    """Weights & Biases, when metrics.backends has wandb."""

    mode: str = doc("offline", "online (needs a wandb login or WANDB_API_KEY), offline (files under run_dir/wandb, "
                    "`wandb sync` later) or disabled", choices=WANDB_MODES)
    project: str = doc("areal_flow", "wandb project")
    entity: Optional[str] = doc(None, "wandb team or user; null = the login's default")
    group: Optional[str] = doc(None, "wandb group; null = one group per Hydra multirun (its sweep directory's name), "
                               "none for a single run")
    tags: List[str] = doc(help="wandb tags", factory=list)
    name: Optional[str] = doc(None, "wandb run name; null = the recipe and the run directory's name")


@dataclass
class MetricsConfig:
    """Where per-step metrics go."""

    backends: List[str] = doc(help="where every step's metrics go: jsonl (metrics.jsonl, always: the progress display, "
                              "plots and `python -m areal_flow.status` read it), tensorboard (run_dir/tensorboard), "
                              "wandb; a backend not listed is not imported", factory=lambda: ["jsonl"],
                              choices=METRICS_BACKENDS)
    wandb: WandbConfig = doc(help="Weights & Biases settings", factory=WandbConfig)
    plot: bool = doc(True, "write a learning-curve PNG beside metrics.jsonl at the end")
    suspect_warn: float = doc(0.05, "warn once (console and metrics) when more than this share of a step's samples is "
                              "suspect (reward/suspect: a gamed or hedged answer, docs/rewards.md); 0 = never",
                              ge=0, le=1)


@dataclass
class EvalConfig:
    """Held-out evaluation during training."""

    every_versions: int = doc(0, "evaluate the held-out set greedily on every Nth policy version's weights, beside "
                              "training (the trainer goes on; the servers load the next version once it ends); "
                              "results keyed by version in metrics.jsonl (0 = never)", ge=0)


@dataclass
class DumpConfig:
    """The trained samples, written out for reading."""

    every_steps: int = doc(0, "every Nth step, each trainer rank writes the samples it trained (prompt, answer, reward, "
                           "versions, advantage, staleness) to run_dir/dumps/step-NNNNNNNN-rankR.jsonl (0 = never)",
                           ge=0)
    tokens: bool = doc(False, "dumps also carry each sample's arrays as lists (prompt and answer ids, behaviour and "
                       "π_prox logprobs, versions, ...), to recompute them offline")
    weights: bool = doc(False, "the trainer also saves the weights of every version it starts a step from, as a "
                        "Hugging Face directory run_dir/dumps/weights/vNNNNNNNN (every step, whatever every_steps: a "
                        "check of the logprobs, tests/test_logprob_audit.py; a model's size a step)")


@dataclass
class FlightConfig:
    """The flight record, for replaying the trainer's side of a run (`python -m areal_flow.replay`)."""

    record: bool = doc(True, "each trainer rank writes what it trained each step, exactly (samples, versions, "
                       "behaviour logprobs, rewards, generator states, a digest of the weights after it), to "
                       "run_dir/flight/step-NNNNNNNN-rankR.msgpack (training/flight.py)")


@dataclass
class RunConfig:
    """One training run."""

    recipe: str = doc("", "name of the recipe, in the run directory's path (set by the recipe file; a recipe file "
                      "that does not set it is named after its file)")
    seed: int = doc(1, "seed of sampling and training")
    output_dir: str = doc("${hydra:runtime.output_dir}", "where this run writes logs, metrics, weights and the checkpoint")
    cache_dir: str = doc("${oc.env:AREAL_FLOW_CACHE,${oc.env:HOME}/.cache/areal_flow}", "generated data and bootstrapped base models, reused across runs")
    dry_run: bool = doc(False, "print the graph and the placement, then exit")
    allocation: Optional[str] = doc(None, "devices and parallelism of generation then training, e.g. 'sglang:d32t2 + "
                                    "megatron:d4p2t4' (d data, t tensor, p pipeline): sets the generate and batch "
                                    "nodes' meshes, layouts and engines and generation.backend/tp_size (docs/allocation.md)")
    total_steps: int = doc(100, "train steps (policy versions) to run", ge=1)
    max_wall_seconds: float = doc(0.0, "stop after this many seconds of training (0 = no limit)", ge=0)
    step_timeout: float = doc(600.0, "fail the run, naming what it waited for, when no train step completes for this many seconds (0 = never)",
                              ge=0)
    eval_at_start: bool = doc(True, "measure held-out greedy accuracy before training")
    eval_at_end: bool = doc(True, "measure held-out greedy accuracy after training")
    cluster: ClusterConfig = doc(help="devices", factory=ClusterConfig)
    model: ModelConfig = doc(help="the starting model", factory=ModelConfig)
    dataset: DatasetConfig = doc(help="prompts", factory=DatasetConfig)
    # Any, not a node config: OmegaConf refuses to assign a dict to a dataclass-typed node, and Hydra's
    # `+graph.<name>={...}` assigns one (a recipe's nodes are merged, which it allows); nor could it
    # pick a type by a key's value. Each node gets its kind's type, defaults and checks in
    # __post_init__ (config/nodes.py: node_config), whenever the config is typed (runtime/spec.py:
    # typed); the composed config holds the nodes as written. `element` names the types for readers
    # of the schema (tools/config_reference.py).
    graph: Dict[str, Any] = field(default_factory=dict, metadata={
        "help": "the MFC nodes, by name; `+graph.<name>={...}` adds one, `~graph.<name>` (or null in a recipe) "
                "removes one; each node's keys are its type's (config/nodes.py)", "element": NODE_CONFIGS})
    algorithm: AlgorithmConfig = doc(help="loss and advantages", factory=AlgorithmConfig)
    rollout: RolloutConfig = doc(help="asynchrony bounds and rollout workers", factory=RolloutConfig)
    generation: GenerationConfig = doc(help="generation servers: backend and SGLang flags", factory=GenerationConfig)
    training: TrainingConfig = doc(help="trainer ranks: number format and memory", factory=TrainingConfig)
    sandbox: SandboxConfig = doc(help="the code sandbox of `code` reward nodes", factory=SandboxConfig)
    launcher: LauncherConfig = doc(help="process start-up", factory=LauncherConfig)
    metrics: MetricsConfig = doc(help="metrics sinks", factory=MetricsConfig)
    eval: EvalConfig = doc(help="held-out evaluation beside training", factory=EvalConfig)
    dump: DumpConfig = doc(help="sample dumps", factory=DumpConfig)
    flight: FlightConfig = doc(help="the flight record, for replay", factory=FlightConfig)
    checkpoint: CheckpointConfig = doc(help="resumable checkpoints", factory=CheckpointConfig)
    recover: RecoverConfig = doc(help="restarts after a fault", factory=RecoverConfig)
    elastic: ElasticConfig = doc(help="the generation servers' autoscaler", factory=ElasticConfig)
    resume: Optional[str] = doc(None, "'auto': continue this run (output_dir) from its latest complete checkpoint, or "
                                "start it when it has none; a checkpoint's path: continue that checkpoint's run, in "
                                "its directory; null = a new run")

    @property
    def batch_invariant_servers(self) -> bool:
        """Whether the embedded servers decode batch-invariantly (generation.deterministic; null: at η = 0)."""
        deterministic = self.generation.deterministic
        return bool(deterministic) if deterministic is not None else self.rollout.max_staleness == 0

    def __post_init__(self) -> None:
        # A node set to null is removed: the way a recipe drops a node of the recipe it extends.
        self.graph = {name: node_config(name, node) for name, node in self.graph.items() if node is not None}


def register_configs() -> None:
    """Put the schema in Hydra's ConfigStore; conf/config.yaml extends it as `base_config`."""
    schema = OmegaConf.structured(RunConfig)
    # The composed nodes are untyped (RunConfig.graph): not in struct mode either, so that an
    # `allocation` can write a node key the recipe left out. A key its node's kind lacks is still named
    # when the config is typed (node_config) and checked (check_known_keys).
    OmegaConf.set_struct(schema.graph, False)
    ConfigStore.instance().store(name="base_config", node=schema)
