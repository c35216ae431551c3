"""The run's checks of a judge: its template's fields, held-out evaluation, its settings' ranges."""

from judge_graphs import build, with_judge

from areal_flow.config.schema import EvalConfig, RunConfig, node_config
from areal_flow.config.validate import check_ranges
from areal_flow.run import checks


def judged_run(**judge):
    nodes = with_judge(**judge)
    cfg = RunConfig(graph={name: node_config(name, node) for name, node in nodes.items()},
                    eval_at_start=False, eval_at_end=False, eval=EvalConfig(every_versions=0))
    return cfg, build(nodes)


def test_a_template_names_only_the_fields_the_judge_reads_and_the_response():
    cfg, graph = judged_run(template="Q: {prompt} A: {response} ref: {answer}")
    assert ("node 'judge': graph.judge.template names {answer}, which is neither a dataset field the node reads "
            "(graph.judge.inputs: prompt) nor {response}") in checks.judge_problems(cfg, graph)
    cfg, graph = judged_run(template="Q: {0}")
    assert any(p.startswith("node 'judge': graph.judge.template: {0} is positional")
               for p in checks.judge_problems(cfg, graph))


def test_held_out_evaluation_needs_a_reward_with_a_dataset_reference():
    cfg, _ = judged_run()
    cfg.eval_at_end = True
    assert ("eval_at_start/eval_at_end/eval.every_versions need a reward node whose reference is a dataset field: "
            "held-out evaluation does not call judges ('judge_reward' reads judge_ids from 'judge')") in \
        checks.judge_problems(cfg, build(_only_judge_rewards()))


def _only_judge_rewards():
    nodes = with_judge()
    del nodes["reward"], nodes["combine"]
    nodes["judge_reward"]["outputs"] = ["rewards"]
    return nodes


def test_a_judges_settings_have_ranges_naming_the_key():
    cfg, _ = judged_run(max_new_tokens=0, temperature=-1.0)
    assert {"graph.judge.max_new_tokens=0 must be ≥ 1", "graph.judge.temperature=-1.0 must be ≥ 0"} <= \
        set(check_ranges(cfg))


def test_the_recipes_judge_passes_the_checks():
    cfg, graph = judged_run()
    assert checks.judge_problems(cfg, graph) == []
