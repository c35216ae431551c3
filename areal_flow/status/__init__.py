"""`python -m areal_flow.status RUN_DIR`: a live view of a run read from its run directory.

`snapshot.py` reads the directory into a `Snapshot` (and probes the processes while the run is
live: `probe.py`), `render.py` turns a snapshot into rich renderables, `__main__.py` refreshes them.
`processes.py` is the run directory's `processes.json`, which the local launcher keeps.
"""
