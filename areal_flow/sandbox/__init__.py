"""The code sandbox, which both code rewards (rewards/code.py) and environments (envs/python_tool.py,
envs/code_feedback.py) run untrusted programs in.

- `local`: the host side, `Sandbox`: one resident `init.py` per sandbox in namespaces of its own
  (pid, network, mount, user), a chroot, a uid per program, rlimits; a program per job.
- `init`: the inside, stdlib only, run as a script: namespaces and root once, a job process per job;
  `cases` (each case's process watched and cleaned up) and `program` (a case's process becoming the
  program, run in the init's interpreter forked; the checker's process) are imported beside it.
- `checker` and `serve`: checked tests. The checker (another uid) holds the tests and expected
  values and calls the program's functions through `serve` (the program's uid) over pipes; results
  cross as plain data only (`plain`). `asserts` bundles them into the scripts the init runs.
- `remote`: the same API against a sandbox service over HTTP (docs/rewards.md).
"""
