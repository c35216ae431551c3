"""A remote code sandbox: a SandboxFusion-style service that clusters often already run.

One `POST {url}/run_code` per test case, the case's input as stdin:

    request  {"code", "language": "python", "stdin", "run_timeout", "memory_limit_MB", "files"}
    response {"status": "Success" | "Failed" | "SandboxError", "message",
              "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error",
                             "return_code", "stdout", "stderr", "execution_time"}}

Function-call tests send the program's side of a checked run (areal_flow/sandbox/serve.py) as the code,
the program as the file `solution.py` (`files` holds base64 contents) and the calls as stdin; the
replies come back as stdout and are checked here, on the host (areal_flow/sandbox/checker.py), so
what a call must return never reaches the service. Each call's own deadline is not kept there: the
whole run gets the calls' share of time. Assert-style tests hold what they expect inside their
source, which would have to run where the program runs: they need the local sandbox, and score
`sandbox_error` here. The service's own isolation is the service's business: this client only maps
its answers onto the local sandbox's case statuses, so the code reward scores both alike.
"""

from __future__ import annotations

import base64
import io
import json
import os
import urllib.error
import urllib.request

from areal_flow.config.schema import SandboxConfig
from areal_flow.sandbox import checker as checks
from areal_flow.sandbox.plain import to_json
from areal_flow.sandbox.local import CaseResult


class RemoteSandbox:
    def __init__(self, cfg: SandboxConfig):
        if not cfg.url:
            raise ValueError("sandbox.backend=remote needs sandbox.url, e.g. http://sandbox:8080")
        self.cfg = cfg
        self.url = cfg.url.rstrip("/") + "/run_code"

    def describe(self) -> str:
        return f"remote sandbox at {self.url}"

    def run(self, program: str, inputs: list[str]) -> list[CaseResult]:
        """The same contract as `Sandbox.run`: per case, what the program printed and a status."""
        results = []
        for stdin in inputs:
            results.append(self._case(program, {}, stdin, self.cfg.wall_seconds))
            if self.cfg.fail_fast and results[-1].status != "ok":
                break
        return results

    def check(self, program: str, script: str, checker: str, job: dict, *, scale: float = 1.0) -> CaseResult:
        """The local sandbox's `check`, for function-call tests: the service runs the program and
        answers every call; the checker runs here on the replies. `checker` (the source) is unused."""
        tests = job["tests"]
        if any("call" not in t for t in tests):
            return CaseResult("sandbox_error", stderr="assert-style tests need sandbox.backend=local: their checks "
                              "hold what they expect, which must not run where the program runs")
        requests = [json.dumps([i, t["call"], to_json(t["args"]), to_json({}), True])
                    for i, t in enumerate(tests)]
        case = self._case(script, {"solution.py": base64.b64encode(program.encode()).decode()},
                          "\n".join(requests) + "\n", self.cfg.wall_seconds * scale)
        replies = os.memfd_create("replies")
        os.write(replies, case.stdout.encode())
        os.lseek(replies, 0, os.SEEK_SET)
        out = io.StringIO()
        try:
            with open(os.devnull, "wb") as sink:
                checks.check({**job, "seconds": None}, checks.Program(sink.fileno(), replies, job["max_reply"]), out)
        finally:
            os.close(replies)
        return CaseResult(case.status, out.getvalue(), case.stderr, case.exit_code, case.seconds)

    def _case(self, code: str, files: dict[str, str], stdin: str, seconds: float) -> CaseResult:
        body = {"code": code, "language": "python", "stdin": stdin, "run_timeout": seconds,
                "memory_limit_MB": self.cfg.memory_mb, "files": files}
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            # The service enforces run_timeout; this bounds a service that stops answering.
            with urllib.request.urlopen(request, timeout=seconds + 30) as response:
                reply = json.loads(response.read())
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
            return CaseResult("sandbox_error", stderr=f"{self.url}: {e}")
        run = reply.get("run_result") or {}
        out, err = str(run.get("stdout") or ""), str(run.get("stderr") or "")
        limit = self.cfg.output_bytes
        seconds = float(run.get("execution_time") or 0.0)
        if reply.get("status") == "SandboxError" or not run:
            return CaseResult("sandbox_error", stderr=str(reply.get("message") or reply)[-2000:])
        if run.get("status") == "TimeLimitExceeded":
            status = "timeout"
        elif len(out) > limit or len(err) > limit:
            status = "output_limit"
        elif run.get("return_code") == 0 and run.get("status") == "Finished":
            status = "ok"
        elif "MemoryError" in err:
            status = "memory_limit"
        else:
            status = "runtime_error"
        return CaseResult(status, out[:limit], err[-4096:], run.get("return_code"), seconds)
