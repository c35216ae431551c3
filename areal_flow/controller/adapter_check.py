"""Proof of arrival, answer by answer (training.lora): every server reports, with each answer's
weight version, the digest of the LoRA adapters it had applied (`meta_info.adapter_digest`; the pool
notes which server answered: messages.Served). The controller holds the trainer's digest of each
version it trained (StepDone.adapter_digest) and checks every scored sample's accounts against it.

The weight update itself is checked too (weights/files.py, weights/sender.py: the server's answer
to the update). This check also covers what an update's answer cannot: a server that joined or came
back serving other adapters, or none, under a version number it reports (veRL #7495: an adapter that
silently never reached the rollout engine). A mismatch stops the run, naming the server and the
version. Versions the controller did not see trained (the base, version 0; those before a resume)
are not checked, nor is a run on real SGLang (`active` false: its servers get merged weights and
report no adapters).
"""

from __future__ import annotations

from areal_flow.transport.messages import GroupMeta


class AdapterMismatch(RuntimeError):
    """A server answered with adapters other than the trainer's for the version it reported."""


class AdapterCheck:
    def __init__(self, active: bool = True) -> None:
        self.active = active  # the servers apply the adapters themselves (the embedded engine)
        self.expected: dict[int, str] = {}  # version -> the trainer's digest of its adapters
        self.problem: str | None = None  # the first mismatch found

    def trained(self, version: int, digest: str) -> None:
        """The trainer trained `version`, whose adapters have `digest` ("" without LoRA: nothing to check)."""
        if digest and self.active:
            self.expected[version] = digest

    def check(self, meta: GroupMeta) -> str | None:
        """The first account of `meta`'s samples that contradicts the trainer's digest, as an error
        message (kept as `problem`), or None."""
        for sample in meta.samples:
            for served in sample.served:
                want = self.expected.get(served.version)
                if want is None or served.adapters == want:
                    continue
                got = f"adapters of digest {served.adapters}" if served.adapters else "no adapters"
                problem = (f"generation server {served.server or '?'} answered sample {sample.uid} (group "
                           f"{meta.group_id}) at weight version {served.version} with {got}; the trainer's "
                           f"adapters of version {served.version} have digest {want}: the adapters it serves are "
                           "not the ones trained (training.lora; docs/lora.md)")
                self.problem = self.problem or problem
                return problem
        return None

    def raise_if_mismatched(self) -> None:
        if self.problem is not None:
            raise AdapterMismatch(self.problem)
