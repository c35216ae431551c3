"""The Ray launcher's resource requests, without a cluster: what each process's bundle asks for."""

import pytest

pytest.importorskip("ray", reason="ray is optional (the GPU image has none)")

from areal_flow.launchers.ray_cluster import _bundle, _sharers  # noqa: E402


def test_colocated_processes_each_ask_ray_for_their_share_of_the_gpu_they_share():
    """Two bundles of half a GPU, which Ray packs onto one GPU of the node; apart, a whole GPU each."""
    from test_local import placed

    for allocation, share in (("embedded:d1 | torch:d1", 0.5), ("embedded:d1 + torch:d1", 1.0)):
        placement = placed(1, 2, allocation)
        procs = {p.name: p for p in placement.procs}
        for name in ("gen_server0", "trainer0"):
            assert _bundle(procs[name], "cuda", _sharers(placement)) == {"GPU": share, "CPU": 1.0}
        assert _bundle(procs["gen_server0"], "cpu", _sharers(placement)) == {"CPU": share}
