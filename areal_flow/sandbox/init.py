"""The inside of the code sandbox: runs as a script (`python -I -S init.py FD`), stdlib only.

It is resident, one per sandbox: it reads a setup frame and then jobs on stdin, and writes one reply
per job on stdout, each a marshalled value behind an 8-byte length. As root it moves into new PID,
network, mount, IPC and UTS namespaces once and forks PID 1 of the new PID namespace, which builds a
root of its own (a tmpfs holding read-only binds of the interpreter's directories, a fresh /proc,
/dev/null and friends), chroots into it and serves the jobs (`serve`).

PID 1 never reads a job. For each job it forks a job process before the job comes (`_one_job`),
which mounts a new size-limited /tmp and /sandbox, reads the job and runs each test case as a
process forked from itself that drops to an unprivileged uid, with resource limits, a scrubbed
environment and no descriptors but its own, and runs the program in this interpreter
(program.py's `_run_script`): started, and with what programs often use imported (PREIMPORTED), once. So a
program costs a fork, not an interpreter's start, and nothing a program must not see is ever in the
process it is forked from: another job's data never (each job has a process of its own), expected
outputs never (the host compares the outputs returned), and a checked job's tests only after the
program is forked (they come on descriptor FD, `_secret`). The cases' processes are
areal_flow/sandbox/cases.py's, what makes one the program areal_flow/sandbox/program.py's. A job whose program is for another
interpreter (sandbox.python) executes that one instead.

After each case the job process kills every process left in the namespace but PID 1 and itself (a
daemon the program left behind) and reaps it, before the reply; when PID 1 exits the kernel kills
whatever remains. See docs/rewards.md for the limits and what each isolation layer stops.
"""

import ctypes
import marshal
import os
import shutil
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # beside us (-I leaves our directory out)
import cases  # noqa: E402
import program  # noqa: E402

del sys.path[0], sys.modules["cases"], sys.modules["program"]  # a program's `import cases` finds nothing of ours


# Jobs and replies travel as marshal (the host runs this same interpreter); signals are numbers.
SIGKILL = 9
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
DEVICES = ("null", "zero", "random", "urandom")
NO_MORE_JOBS = 3  # a job process's exit code when the host closed stdin
WRITABLE = {"/tmp": "1777", "/sandbox": "700"}  # the writable directories, new for each job

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or fstype} on {target}")


def _bind_readonly(path: str, root: str) -> None:
    """Show `path` at the same place under `root`, read-only; a symlink is recreated as one."""
    target = root + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path):
        if not os.path.lexists(target):
            os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "a").close()
    _mount(path, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(root: str, ro_paths: list) -> None:
    """The filesystem programs see: nothing of the host but the read-only paths they need."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in ro_paths:
        if os.path.lexists(path):
            _bind_readonly(path, root)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/dev")
    for dev in DEVICES:
        open(f"{root}/dev/{dev}", "a").close()
        _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    for path in WRITABLE:
        os.makedirs(root + path)
    os.chroot(root)
    os.chdir("/")
    # No System V IPC object or POSIX message queue can be made: they would outlive the job that
    # made them in this IPC namespace, which every job of the sandbox shares.
    for key, value in (("kernel/shmmni", "0"), ("kernel/msgmni", "0"), ("kernel/sem", "250 32000 32 0"),
                       ("fs/mqueue/queues_max", "0")):
        with open(f"/proc/sys/{key}", "w") as f:
            f.write(value)


def fresh_dirs(setup: dict) -> None:
    """A new, empty /tmp and /sandbox for the next job (size-limited tmpfs, the programs' uid's):
    nothing a job wrote reaches the next."""
    uid, disk = setup["uid"], f"size={setup['disk_mb']}m"
    for path, mode in WRITABLE.items():
        libc.umount2(path.encode(), MNT_DETACH)  # the last job's, if any
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"{disk},mode={mode},uid={uid},gid={uid}")


def serve(setup: dict, isolation: dict, failed: str | None = None) -> None:
    """Serve jobs until the host closes stdin: as PID 1 of the sandbox's namespaces, chrooted into its
    root, where `isolation` has them. Each job is read and run by a child forked for it before the
    job comes (`_one_job`), and programs are forked from that child: so no job's data (programs,
    inputs, outputs, tests) is ever in a process that a later job's program is forked from."""
    isolated = isolation["pid_namespace"]
    if failed is None:  # else each job is answered with it
        try:
            if isolated:
                build_root(setup["root"], setup["ro_paths"])
            else:
                os.chmod(setup["root"], 0o711)  # each job's directory in it is its uid's alone
        except OSError as e:
            failed = f"sandbox setup failed: {e}"
    last = None
    while True:
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(done_r)
            os._exit(_one_job(setup, isolation, failed, done_w))
        os.close(done_w)
        if last is not None:
            os.waitpid(last, 0)  # the last job's process, which exits right after its reply
        last = pid
        said = os.read(done_r, 1)  # once its processes are gone: the next job process starts meanwhile
        os.close(done_r)
        if said == bytes([NO_MORE_JOBS]):
            return
        if not said:  # it died mid-job: what it left goes too
            os.waitpid(pid, 0)
            if isolated:
                cases.kill_all_but_me(True)
            _write_frame(1, {"isolation": isolation, "error": "the sandbox's job process died"})
            last = None


def _one_job(setup: dict, isolation: dict, failed: str | None, done: int) -> int:
    """In the child forked for the next job: read it, run it, say on `done` that its processes are
    gone, write its reply. The exit code."""
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # what the job's processes leave is ours to reap
    isolated = isolation["pid_namespace"]
    workdir = "/sandbox" if isolated else os.path.join(setup["root"], f"job{os.getpid()}")
    try:
        if failed is None:  # ready before the job comes
            fresh_dirs(setup) if isolated else os.mkdir(workdir)
    except OSError as e:
        failed = f"sandbox setup failed: {e}"
    job = _read_frame(0)
    if job is None:
        os.write(done, bytes([NO_MORE_JOBS]))
        return NO_MORE_JOBS
    try:
        if failed is not None:
            raise OSError(failed)
        reply = {"cases": cases.run_cases(job, workdir, isolated, lambda: _secret(job["checker"]["id"]))}
    except BaseException as e:  # noqa: BLE001 - a reply, whatever went wrong
        reply = {"error": str(e) if failed is not None else f"the sandbox could not run the job: {e}"}
    if not isolated:
        shutil.rmtree(workdir, ignore_errors=True)
    os.write(done, b"\0")
    _write_frame(1, {"isolation": isolation, **reply})
    return 0


def _secret(job_id: int):
    """The tests of checked job `job_id`, from the descriptor (argv[1]) only a job process reads, once
    it forked the program: frames of jobs that ended before reading theirs are passed over."""
    while True:
        frame = _read_frame(SECRETS)
        if frame is None:
            raise OSError("the host closed the tests' channel")
        if frame["id"] == job_id:
            return frame["job"]


def _read_exactly(n: int, fd: int = 0) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_frame(fd: int):
    """The next marshalled value behind its 8-byte length, or None at the end of input."""
    header = _read_exactly(8, fd)
    return None if header is None else marshal.loads(_read_exactly(struct.unpack("<Q", header)[0], fd))


def _write_frame(fd: int, value) -> None:
    data = marshal.dumps(value)
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def main() -> None:
    """Read the setup frame (root, ro_paths, isolate), make the namespaces, and serve jobs in them
    (as PID 1, forked: the namespaces die with it, and it dies with us)."""
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # the host's worker died: so do we
    setup = _read_frame(0)
    isolation = {"pid_namespace": False, "network_namespace": False, "mount_namespace": False,
                 "unprivileged_user": os.geteuid() == 0, "rlimits": True}
    if not setup["isolate"]:  # opted out of isolation: a directory of its own, the uid and the limits
        serve(setup, isolation)
        return
    try:
        _check(libc.unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    except OSError as e:
        serve(setup, isolation, f"namespaces unavailable ({e.strerror}; they need root or CAP_SYS_ADMIN)")
        return
    isolation.update(pid_namespace=True, network_namespace=True, mount_namespace=True)
    pid = os.fork()
    if pid == 0:
        libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
        serve(setup, isolation)
        os._exit(0)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    SECRETS = int(sys.argv[1])  # the checked jobs' tests: never read here, only by a job's process
    main()
