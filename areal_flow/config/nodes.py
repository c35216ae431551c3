"""A graph node's keys, by its kind: `graph.<name>` is typed by its `type` (NODE_CONFIGS), so a
node holds its own kind's keys and no other's (a reward node has no mesh, a train node no `fn`).

Hydra composes the nodes untyped (config/schema.py: RunConfig.graph); `node_config` types each one
when the config is typed, and a key of another kind is then named as that kind's
(`config/validate.py: check_known_keys`). What each kind reads and writes, and the rules between
nodes, are the graph's (graph/keys.py, graph/node.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from areal_flow.config.fields import doc
from areal_flow.config.validate import ConfigError


@dataclass
class NodeConfig:
    """One model function call (MFC) of the graph: the keys of every kind. Edges come from the keys
    it reads and writes."""

    type: str = doc("", "generate | reward | combine | inference | train")
    role: Optional[str] = doc(None, "model role: actor | ref | critic (a value head on the actor's architecture) | "
                              "judge (a generate node serving a frozen model, docs/judge.md); none for reward/combine")
    inputs: List[str] = doc(help="keys this node reads (from the dataset or from another node)", factory=list)
    outputs: List[str] = doc(help="keys this node writes", factory=list)
    keys: Dict[str, str] = doc(help="well-known key -> the name this node writes it under, e.g. {prox_logprobs: old_logp}",
                               factory=dict)

    def elsewhere(self, key: str) -> str:
        """'; KEY is a key of K nodes, not of a T node' when another kind declares `key`, else ''."""
        kinds = sorted({t for t, cls in NODE_CONFIGS.items() if key in {x.name for x in dataclasses.fields(cls)}})
        article = "an" if self.type[:1] in tuple("aeiou") else "a"
        return f"; {key} is a key of {', '.join(kinds)} nodes, not of {article} {self.type} node" if kinds else ""


@dataclass
class GenerateNodeConfig(NodeConfig):
    """A generate node: the policy's (role actor), its rollouts one turn a sample, an environment's
    turns or an agent's calls; or a judge's (role judge), a frozen model on servers of its own."""

    mesh: Optional[str] = doc(None, "devices of this node's generation servers, e.g. '0', '0-3' or '0,2'")
    model: Optional[str] = doc(None, "generate nodes of role judge: the judge's Hugging Face dir (weights + "
                               "tokenizer), never updated; null = the run's starting model, frozen")
    template: Optional[str] = doc(None, "generate nodes of role judge: format string of the judge's prompt over the "
                                  "dataset fields it reads (as in the data, before dataset.prompt_template) and "
                                  "{response}, the policy's answer text")
    chat_template: bool = doc(False, "generate nodes of role judge: wrap the judge's prompt in the judge tokenizer's "
                              "chat template as one user message")
    max_new_tokens: Optional[int] = doc(None, "generate nodes of role judge: the judge's answer budget; null = "
                                        "algorithm.max_new_tokens", ge=1)
    temperature: float = doc(0.0, "generate nodes of role judge: the judge's sampling temperature; 0 = greedy "
                             "(reproducible verdicts)", ge=0)
    env: Optional[str] = doc(None, "generate nodes of role actor: the environment that answers each policy turn "
                             "(docs/agents.md): python_tool, or 'package.module:Class'; null = one turn a sample")
    env_settings: Dict[str, Any] = doc(help="generate nodes with env: the environment's settings (python_tool: open, "
                                       "close, wall_seconds, max_output_chars, ascii_only, concurrency)", factory=dict)
    max_turns: int = doc(4, "generate nodes with env: policy turns a trajectory may take at most", ge=1)
    max_trajectory_tokens: Optional[int] = doc(None, "generate nodes with env: token budget of a trajectory, its "
                                               "prompt and every turn and observation; null = the model's context "
                                               "(max_position_embeddings)", ge=1)
    env_error_share: float = doc(0.5, "generate nodes with env: stop the run when the environment raised in more "
                                 "than this share of the last 200 trajectories (each such trajectory's group is "
                                 "dropped, counted in env/errors); 1 = never", ge=0, le=1)
    agent: Optional[str] = doc(None, "generate nodes of role actor: 'package.module:function', an async function "
                               "(client: openai.AsyncOpenAI, row: dict) -> reward that runs each rollout through the "
                               "OpenAI gateway (docs/agents.md); null = none")
    agent_wall_seconds: float = doc(120.0, "generate nodes with agent: wall time of one rollout; past it the agent is "
                                    "cut off and the rollout failed", gt=0)
    agent_roles: List[str] = doc(help="generate nodes with agent: the policy's roles in one rollout (e.g. [solver, "
                                 "checker]); the agent is run(clients: {role: client}, row) -> {role: reward}, each "
                                 "role's last trajectory a sample of its own, its advantages normalised among its "
                                 "role's samples of the group (group_size / roles rollouts a group); empty = one role, "
                                 "run(client, row) -> reward", factory=list)
    agent_drift: str = doc("last_segment", "generate nodes with agent: a rollout whose history left the recorded "
                           "tokens (a drift, docs/agents.md): last_segment = train the trajectory of its last call, its "
                           "earlier segments dropped (counted in agent/dropped_tokens); drop = the rollout fails (run "
                           "again, then its group dropped, the ledger naming the drift)",
                           choices=("last_segment", "drop"))
    agent_retries: int = doc(1, "generate nodes with agent: a failed rollout (the agent raised, timed out, made no "
                             "call or returned no reward) runs again this many times, then its group is dropped "
                             "(the ledger names the failure)", ge=0)


@dataclass
class BatchNodeConfig(NodeConfig):
    """An inference or train node: a model on its mesh, over a batch of packed micro-batches."""

    mesh: Optional[str] = doc(None, "devices of this node, e.g. '0', '0-3' or '0,2'")
    micro_batch_tokens: int = doc(8192, "token budget of one packed micro-batch (batch nodes)", ge=1)
    row_tokens: Optional[int] = doc(None, "batch nodes, torch engine: split each micro-batch into packed rows of at most "
                                    "this many tokens, run as one call (fast on CPU); none = one row", ge=1)
    engine: str = doc("torch", "batch nodes: the engine of the node's role; torch = PyTorch with FSDP2 data parallel, "
                      "megatron = megatron-core tensor/pipeline/data parallel", choices=("torch", "megatron"))
    parallel: Any = doc(None, "batch nodes: layout on the mesh, {dp, tp, pp} or 'd2p2t2' (tp/pp need engine megatron); "
                        "none = every device data parallel")


@dataclass
class RewardNodeConfig(NodeConfig):
    """A reward node: a function that scores each sample, in worker processes of its own."""

    workers: int = doc(1, "reward nodes: worker processes that score samples in parallel", ge=1)
    fn: str = doc("", "reward nodes: arith | arith_format | math | code | judge | judge_agree (a judge's answer as "
                  "the reference), or 'module:function' of your own (docs/rewards.md has the signature)")
    timeout: float = doc(30.0, "reward nodes: seconds to score one sample; past it the sample scores 0 and "
                         "counts in reward/<node>_timeout", gt=0)
    scale: float = doc(1.0, "reward nodes: shaping, reward = clip((r + bias) * scale, -clip, clip); "
                       "AReaL's ±5 for right/wrong is bias -0.5, scale 10")
    bias: float = doc(0.0, "reward nodes: added to the function's value before scaling")
    clip: Optional[float] = doc(None, "reward nodes: bound of the shaped reward's magnitude; null = none", gt=0)


@dataclass
class CombineNodeConfig(NodeConfig):
    """A combine node: a weighted sum of other nodes' keys."""

    weights: Dict[str, float] = doc(help="combine nodes: input key -> weight; the output is the weighted sum",
                                    factory=dict)


@dataclass
class UntypedNodeConfig(GenerateNodeConfig, BatchNodeConfig, RewardNodeConfig, CombineNodeConfig):
    """A node of no known type (or none: an override of a mistyped node name) holds every kind's
    keys, so that the graph names what is wrong with it (graph/node.py), not each of its keys."""


NODE_CONFIGS: dict[str, type[NodeConfig]] = {
    "generate": GenerateNodeConfig, "inference": BatchNodeConfig, "train": BatchNodeConfig,
    "reward": RewardNodeConfig, "combine": CombineNodeConfig}
"""Each node type's keys; a node of no known type gets UntypedNodeConfig's."""


def node_config(name: str, node: Any) -> NodeConfig:
    """Node `name` of the graph as written (a mapping) typed by its kind (NODE_CONFIGS[type]): its
    kind's defaults under it, each value converted to its field's type or refused by OmegaConf
    naming `graph.<name>.<key>`. A key its kind does not declare is kept as an extra attribute, as
    OmegaConf keeps a key added with '+' anywhere in the config, for `config/validate.py:
    check_known_keys` to name with the others."""
    if isinstance(node, NodeConfig):
        return node
    if not isinstance(node, dict) and not OmegaConf.is_dict(node):
        raise ConfigError([f"graph.{name}={node!r}: a node is a mapping of its keys (type, inputs, outputs, ...), "
                           "or null to remove it"])
    cls = NODE_CONFIGS.get(str(node.get("type") or ""), UntypedNodeConfig)
    root = OmegaConf.create({"graph": {name: OmegaConf.structured(cls)}})  # errors name graph.<name>.<key>
    typed = root.graph[name]
    try:
        with open_dict(typed):
            typed.merge_with(node)
    except OmegaConfBaseException as e:  # a value of the wrong type, as Hydra would have said while composing
        raise ConfigError([f"{e.full_key}: {str(e).splitlines()[0]}"]) from None
    return OmegaConf.to_object(typed)
