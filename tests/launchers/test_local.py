import os
import subprocess
import sys
import textwrap
import time

import pytest

from areal_flow.graph.placement import Proc
from areal_flow.launchers.local import ChildFailed, LocalLauncher, exception_line


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_a_dying_child_stops_the_run_with_its_name_and_traceback(tmp_path):
    launcher = LocalLauncher(str(tmp_path), stop_timeout=2)
    launcher.start(Proc("sleeper", "rollout"), py("import time; time.sleep(60)"))
    launcher.start(Proc("controller", "controller"), py("import time; time.sleep(60)"))
    launcher.start(Proc("reward0", "reward"), py("""
        import time
        time.sleep(0.3)
        def score(x):
            raise ValueError(f"cannot score {x!r}")
        score("7+8=")
    """))
    with pytest.raises(ChildFailed) as e:
        launcher.wait("controller", interval=0.05)
    launcher.stop_all()
    err = e.value
    assert err.name == "reward0" and err.returncode == 1
    assert "Traceback (most recent call last)" in err.traceback
    assert "ValueError: cannot score '7+8='" in err.traceback
    assert "reward0" in str(err) and err.log_path.endswith("logs/reward0.log")
    # The whole reason on one line: the process, how it ended, the exception that ended it.
    assert err.reason == f"process 'reward0' exited with code 1: ValueError: cannot score '7+8='; its log is {err.log_path}"
    assert all(c.popen.poll() is not None for c in launcher.children.values())  # no one left running


def test_the_exception_line_of_a_traceback_names_its_type_without_its_module():
    frames = 'Traceback (most recent call last):\n  File "main.py", line 9, in run\n    await train()\n    ^^^^^^^^^^^^^\n'
    assert exception_line(frames + "areal_flow.controller.main.StalledRun: no train step completed; waits for x") == \
        "StalledRun: no train step completed; waits for x"
    assert exception_line(frames + "KeyboardInterrupt") == "KeyboardInterrupt"
    assert exception_line(frames + "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)\nmore") == \
        "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"
    assert exception_line("the last lines of a log\nwithout a traceback") == ""
    assert str(ChildFailed("rollout0", -9, "its Ray actor is gone: ActorDiedError", "logs/rollout0.log")).startswith(
        "process 'rollout0' was killed by signal 9: its Ray actor is gone: ActorDiedError; its log is logs/rollout0.log\n")


def test_a_native_crash_is_reported_with_the_stacks_faulthandler_wrote(tmp_path):
    launcher = LocalLauncher(str(tmp_path), stop_timeout=2)
    launcher.start(Proc("controller", "controller"), py("import time; time.sleep(60)"))
    launcher.start(Proc("trainer0", "trainer"), py("""
        import faulthandler, os
        faulthandler.enable()
        try:
            raise ValueError("handled, and not what killed the process")
        except ValueError:
            import traceback; traceback.print_exc()
        def load_the_weights():
            os.abort()
        load_the_weights()
    """))
    with pytest.raises(ChildFailed) as e:
        launcher.wait("controller", interval=0.05)
    launcher.stop_all()
    err = e.value
    assert err.name == "trainer0" and err.returncode == -6 and "killed by signal 6" in str(err)
    # The crash's dump, the last trace in the log, not the earlier handled traceback.
    assert err.traceback.startswith("Fatal Python error: Aborted")
    assert err.reason.startswith("process 'trainer0' was killed by signal 6: Fatal Python error: Aborted; its log is")
    assert "in load_the_weights" in err.traceback and "ValueError" not in err.traceback


def test_a_child_that_ignores_sigterm_is_killed(tmp_path):
    launcher = LocalLauncher(str(tmp_path), stop_timeout=0.5)
    launcher.start(Proc("stubborn", "rollout"), py("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """))
    log = tmp_path / "logs" / "stubborn.log"
    deadline = time.time() + 10
    while "ready" not in log.read_text() and time.time() < deadline:
        time.sleep(0.05)
    t0 = time.time()
    launcher.stop_all()
    assert launcher.children["stubborn"].popen.returncode == -9
    assert time.time() - t0 < 5


def test_a_clean_controller_exit_ends_the_wait(tmp_path):
    launcher = LocalLauncher(str(tmp_path))
    launcher.start(Proc("controller", "controller"), py("print('done')"))
    launcher.start(Proc("worker", "rollout"), py("import time; time.sleep(60)"))
    launcher.wait("controller", interval=0.05)
    launcher.stop_all()
    assert launcher.children["worker"].popen.returncode is not None


def test_children_die_with_the_launcher_process(tmp_path):
    """kill -9 of the launcher leaves no orphans (PR_SET_PDEATHSIG)."""
    script = textwrap.dedent(f"""
        import sys, time
        from areal_flow.graph.placement import Proc
        from areal_flow.launchers.local import LocalLauncher
        l = LocalLauncher({str(tmp_path)!r})
        l.start(Proc("orphan", "rollout"), [sys.executable, "-c", "import time; time.sleep(60)"])
        print(l.children["orphan"].popen.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    assert alive(child_pid)
    parent.kill()
    parent.wait()
    deadline = time.time() + 5
    while alive(child_pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(child_pid)


def placed(n_nodes: int, n_devices: int, allocation: str):
    """The placement `python -m areal_flow.launch` makes of the default recipe under `allocation` on cuda."""
    from hydra import compose, initialize_config_dir

    from areal_flow.graph import graph_from_config, place
    from areal_flow.graph.allocation import apply_allocation, parse_allocation
    from areal_flow.launch import CONF_DIR
    from areal_flow.runtime.spec import typed

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        raw = compose("config", overrides=[f"cluster.n_nodes={n_nodes}", f"cluster.n_devices={n_devices}",
                                           "cluster.device_type=cuda", f"allocation={allocation}",
                                           "output_dir=/tmp/unused"])
    apply_allocation(raw, parse_allocation(allocation))
    cfg = typed(raw)
    return place(graph_from_config(cfg), cfg.rollout.workers, cfg.generation.tp_size, n_devices)


@pytest.mark.parametrize("n_nodes,n_devices,allocation,expected", [
    # One GPU shared (colocated): the server and the trainer rank both see GPU 0.
    (1, 1, "embedded:d1 | torch:d1", {"gen_server0": "0", "trainer0": "0"}),
    # 8 GPUs split: four servers of one GPU, then four trainer ranks of one GPU each.
    (1, 8, "embedded:d4 + torch:d4", {"gen_server0": "0", "gen_server3": "3", "trainer0": "4", "trainer3": "7"}),
    # 2 nodes of 4: the trainer ranks on node 1 see that node's GPUs, numbered from 0 there.
    (2, 4, "sglang:d2t2 + torch:d4", {"gen_server0": "0,1", "gen_server1": "2,3", "trainer0": "0", "trainer3": "3"}),
])
def test_each_gpu_process_sees_exactly_its_meshs_gpus_numbered_on_its_node(tmp_path, n_nodes, n_devices, allocation,
                                                                           expected):
    procs = {p.name: p for p in placed(n_nodes, n_devices, allocation).procs}
    launcher = LocalLauncher(str(tmp_path), device_type="cuda", stop_timeout=2)
    for name in [*expected, "controller"]:
        launcher.start(procs[name], py("import os; print('seen:', os.environ.get('CUDA_VISIBLE_DEVICES'))"))
    for child in launcher.children.values():
        assert child.popen.wait(timeout=30) == 0
    for name, devices in {**expected, "controller": "None"}.items():  # a light process gets no GPU
        assert (tmp_path / "logs" / f"{name}.log").read_text().strip() == f"seen: {devices}"
    if n_nodes > 1:
        assert procs["trainer0"].node == 1 and procs["gen_server0"].node == 0
