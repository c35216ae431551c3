"""servers.json as a process that starts during a scale-up reads it (generation/client/membership.py):
a server still joining may not serve the current weights, and a pool takes its first servers
without the version check, so a starting process leaves it out until it is listed serving."""

import asyncio

from generation_helpers import ModelDirs, running_server

from areal_flow.config.schema import RolloutConfig
from areal_flow.generation.client.membership import Member, Membership, apply, servers_of, write_membership
from areal_flow.generation.client.router import SERVED_BY, ServerPool


def test_a_process_started_during_a_scale_up_sends_nothing_to_a_server_still_joining(model_dirs: ModelDirs, tmp_path):
    """gen_server1 joins at version 0 while the run serves version 3 (the controller's pool has not
    loaded the weights on it yet): a rollout worker restarted now routes every request to
    gen_server0; once the launcher lists gen_server1 serving, the worker's follower takes it."""
    run_dir = str(tmp_path)
    with running_server(model_dirs.a, max_batch_size=8, weight_label="3") as current, \
            running_server(model_dirs.a, max_batch_size=8) as joining:
        spec = (["gen_server0"], [current.url])
        write_membership(run_dir, Membership(2, {"gen_server0": Member(current.url),
                                                 "gen_server1": Member(joining.url, joining=True)}))
        names, urls = servers_of(run_dir, *spec)
        assert (names, urls) == spec

        async def restarted_worker() -> tuple[set[str], set[str], list[str]]:
            pool = ServerPool(urls, names, RolloutConfig())
            try:
                answers = await asyncio.gather(*[pool.generate([2, 3, 4], {"max_new_tokens": 2}) for _ in range(8)])
                listed = Membership(3, {"gen_server0": Member(current.url), "gen_server1": Member(joining.url)})
                apply(pool, listed)  # the follower's next look: now serving
                return ({a["meta_info"][SERVED_BY] for a in answers}, {a["meta_info"]["weight_version"] for a in answers},
                        [s.name for s in pool.servers])
            finally:
                await pool.close()

        served, versions, taken = asyncio.run(restarted_worker())
        assert served == {"gen_server0"} and versions == {"3"}
        assert taken == ["gen_server0", "gen_server1"]
        write_membership(run_dir, Membership(3, {"gen_server0": Member(current.url), "gen_server1": Member(joining.url)}))
        assert servers_of(run_dir, *spec) == (["gen_server0", "gen_server1"], [current.url, joining.url])
