"""A remote code sandbox: a SandboxFusion-style service that clusters often already run.

One `POST {url}/run_code` per test case, the case's input as stdin:

    request  {"code", "language": "python", "stdin", "run_timeout", "memory_limit_MB", "files"}
    response {"status": "Success" | "Failed" | "SandboxError", "message",
              "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error",
                             "return_code", "stdout", "stderr", "execution_time"}}

Function-call and assert-style tests send the harness as the code and the program as the file
`solution.py` (`files` holds base64 contents). The service's own isolation is the service's business: this client
only maps its answers onto the local sandbox's case statuses, so the code reward scores both alike.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

from areal_flow.config.schema import SandboxConfig
from areal_flow.rewards.sandbox import CaseResult


class RemoteSandbox:
    def __init__(self, cfg: SandboxConfig):
        if not cfg.url:
            raise ValueError("sandbox.backend=remote needs sandbox.url, e.g. http://sandbox:8080")
        self.cfg = cfg
        self.url = cfg.url.rstrip("/") + "/run_code"

    def describe(self) -> str:
        return f"remote sandbox at {self.url}"

    def run(self, program: str, inputs: list[str], *, script: str | None = None,
            scale: float = 1.0) -> list[CaseResult]:
        """The same contract as `Sandbox.run`: per case, what the program printed and a status."""
        if script is None:
            code, files = program, {}
        else:
            code, files = script, {"solution.py": base64.b64encode(program.encode()).decode()}
        results = []
        for stdin in inputs:
            results.append(self._case(code, files, stdin, self.cfg.wall_seconds * scale))
            if self.cfg.fail_fast and results[-1].status != "ok":
                break
        return results

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
