"""The cluster tier: a real Slurm of two nodes, each in a network namespace of its own (slurm_cluster.py,
netns_hosts.py), shared by the tier's tests. Run as root: `python -m pytest -q -m cluster -n 0`."""

import os

import pytest
from netns_hosts import Hosts
from slurm_cluster import SlurmCluster, install


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the cluster tier runs as root: it makes network namespaces and starts slurmd")
    install()
    hosts = Hosts(2).up()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), hosts)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        hosts.down()
