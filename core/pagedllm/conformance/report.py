"""The conformance report: one row per case, rendered as a support matrix (markdown), JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

STATUSES = ("passing", "failing", "untested")  # CaseResult.status
#: A whole run: FAIL (a case failed), PARTIAL (nothing failed, but a case the backend declares was not run), PASS.
PASS, PARTIAL, FAIL = "PASS", "PARTIAL", "FAIL"
#: How a passing feature was verified (``Report.verification``); a feature not run or failing is not verified.
HARDWARE, SIMULATION, NOT_VERIFIED = "verified-on-hardware", "verified-on-CPU-simulation", "not-verified"
#: A feature whose passing cases all ran core's reference code (the backend implements none of their hooks): it works
#: on the backend, but nothing of the backend's own was verified.
REFERENCE_FALLBACK = "reference-fallback"
#: A feature all of whose cases the backend's capabilities rule out.
NOT_APPLICABLE = "not-applicable"


@dataclass
class CaseResult:
    """One row: ``feature`` groups hooks, ``kernel`` names the hook and variant, ``model`` the shapes or model."""

    feature: str
    kernel: str
    model: str
    dtype: str
    status: str  # passing | failing | untested
    error: str = ""  # why it failed, or why it was not tested
    detail: str = ""  # informational notes
    max_abs_err: Optional[float] = None
    seconds: float = 0.0
    #: untested because the backend's capabilities rule the case out (not a gap in testing: it never runs there)
    not_applicable: bool = False
    #: the backend implements none of the case's hooks: it ran core's reference code, not the backend's own
    fallback: bool = False

    @property
    def id(self) -> str:
        return case_id(self.kernel, self.model, self.dtype)


def case_id(kernel: str, model: str, dtype: str) -> str:
    """What allow/exclude/tolerance patterns match: ``kernel[model|dtype]``."""
    return f"{kernel}[{model}|{dtype}]"


@dataclass
class Report:
    backend: str
    device: str
    results: list[CaseResult] = field(default_factory=list)
    environment: dict = field(default_factory=dict)
    #: HARDWARE when run on the backend's real device (with ``evidence``), SIMULATION under a simulated device layer,
    #: NOT_VERIFIED when nothing showed the device is real
    verification: str = HARDWARE
    simulated: str = ""  # what simulated the device, when verification is SIMULATION
    evidence: str = ""  # what showed the device is real, or why the run is not verified

    @property
    def passed(self) -> bool:
        """No case failed (untested cases do not fail a run, but make it :data:`PARTIAL`, see :attr:`status`)."""
        return not self.failing

    @property
    def status(self) -> str:
        """FAIL if a case failed; PARTIAL if a case that applies to the backend was not run; else PASS."""
        if self.failing:
            return FAIL
        if any(r.status == "untested" and not r.not_applicable for r in self.results):
            return PARTIAL
        return PASS

    def features(self) -> dict[str, str]:
        """``{feature: verification level}``: the report's level where every applicable case of the feature ran and
        passed and one of them ran the backend's own hooks; :data:`REFERENCE_FALLBACK` where they all passed on core's
        reference code alone; :data:`NOT_APPLICABLE` where the backend declares none of it; else :data:`NOT_VERIFIED`
        (never claimed for a case that was not run)."""
        out: dict[str, str] = {}
        for feature in dict.fromkeys(r.feature for r in self.results):
            rows = [r for r in self.results if r.feature == feature and not r.not_applicable]
            if not rows:
                out[feature] = NOT_APPLICABLE
                continue
            ok = all(r.status == "passing" for r in rows)
            own = any(not r.fallback for r in rows)
            out[feature] = (self.verification if own else REFERENCE_FALLBACK) if ok else NOT_VERIFIED
        return out

    @property
    def failing(self) -> list[CaseResult]:
        return [r for r in self.results if r.status == "failing"]

    def counts(self) -> dict[str, int]:
        """``passing`` / ``failing`` by status; ``untested``: applicable cases not run; ``not_applicable``: cases the
        backend's capabilities rule out (never run); ``reference_fallback``: the passing cases that ran only core's
        reference code."""
        return {"passing": sum(r.status == "passing" for r in self.results),
                "failing": sum(r.status == "failing" for r in self.results),
                "untested": sum(r.status == "untested" and not r.not_applicable for r in self.results),
                "not_applicable": sum(r.not_applicable for r in self.results),
                "reference_fallback": sum(r.status == "passing" and r.fallback for r in self.results)}

    # ---- renderings ------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"backend": self.backend, "device": self.device, "status": self.status,
                           "verification": self.verification, "simulated": self.simulated, "evidence": self.evidence,
                           "features": self.features(), "environment": self.environment,
                           "counts": self.counts(), "results": [asdict(r) for r in self.results]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Report":
        d = json.loads(text)
        known = set(CaseResult.__dataclass_fields__)
        return cls(d["backend"], d["device"], [CaseResult(**{k: v for k, v in r.items() if k in known})
                                              for r in d["results"]],
                   d.get("environment", {}), d.get("verification", HARDWARE), d.get("simulated", ""),
                   d.get("evidence", ""))

    def to_csv(self) -> str:
        buf = io.StringIO()
        names = ["feature", "kernel", "model", "dtype", "status", "not_applicable", "fallback", "max_abs_err",
                 "seconds", "error", "detail"]
        w = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
        w.writeheader()
        for r in self.results:
            w.writerow({k: getattr(r, k) for k in names})
        return buf.getvalue()

    def matrix(self) -> tuple[list[str], dict[tuple[str, str], dict[str, list[CaseResult]]]]:
        """(dtypes, {(feature, kernel): {dtype: results}})."""
        order = ("float32", "float16", "bfloat16")
        dtypes = sorted({r.dtype for r in self.results},
                        key=lambda d: (d == "-", order.index(d) if d in order else len(order), d))
        cells: dict[tuple[str, str], dict[str, list[CaseResult]]] = {}
        for r in self.results:
            cells.setdefault((r.feature, r.kernel), {}).setdefault(r.dtype, []).append(r)
        return dtypes, cells

    def to_markdown(self) -> str:
        c = self.counts()
        own = c["passing"] - c["reference_fallback"]
        lines = [f"# Conformance: backend `{self.backend}` ({self.device})", "",
                 f"**{self.status}**: {own} passing on the backend's own hooks, {c['reference_fallback']} passing on "
                 f"core's reference fallback, {c['failing']} failing, {c['untested']} untested; "
                 f"{c['not_applicable']} not applicable (the backend does not declare them: never run).", "",
                 f"Verification: {self.verification}" + (f" ({self.simulated})" if self.simulated else "")
                 + (f"; evidence: {self.evidence}" if self.evidence else ""), ""]
        if self.environment:
            lines += [", ".join(f"{k}: {v}" for k, v in self.environment.items()), ""]
        dtypes, cells = self.matrix()
        lines += ["| feature | kernel | " + " | ".join(dtypes) + " |", "|---|---|" + "---|" * len(dtypes)]
        for (feature, kernel), by_dtype in cells.items():
            row = [feature, kernel] + [_cell(by_dtype.get(d, [])) for d in dtypes]
            lines.append("| " + " | ".join(row) + " |")
        for title, pick in (("Failing", lambda r: r.status == "failing"),
                            ("Untested", lambda r: r.status == "untested" and not r.not_applicable),
                            ("Not applicable", lambda r: r.not_applicable)):
            rows = [r for r in self.results if pick(r)]
            if rows:
                lines += ["", f"## {title}", ""]
                lines += [f"- `{r.id}`: {r.error.splitlines()[0] if r.error else ''}" for r in rows]
        fallback = [r for r in self.results if r.status == "passing" and r.fallback]
        if fallback:
            lines += ["", "## Reference fallback", "", "Passing, but on core's reference code (the backend implements "
                      "none of these hooks), so not counted as the backend's verified features: "
                      + ", ".join(f"`{k}`" for k in dict.fromkeys(r.kernel for r in fallback))]
        return "\n".join(lines) + "\n"

    def write(self, report_dir: str) -> dict[str, str]:
        """Write ``conformance-<backend>.{md,json,csv}`` into ``report_dir``; returns the paths."""
        os.makedirs(report_dir, exist_ok=True)
        paths = {}
        for ext, text in (("md", self.to_markdown()), ("json", self.to_json()), ("csv", self.to_csv())):
            paths[ext] = os.path.join(report_dir, f"conformance-{self.backend}.{ext}")
            with open(paths[ext], "w") as f:
                f.write(text)
        return paths


def _cell(results: list[CaseResult]) -> str:
    if not results:
        return ""
    n = len(results)
    fail = sum(r.status == "failing" for r in results)
    ok = sum(r.status == "passing" for r in results)
    if fail:
        return f"FAIL {fail}/{n}"
    if all(r.not_applicable for r in results):
        return "n/a"
    word = "ref fallback" if ok and all(r.fallback for r in results if r.status == "passing") else "pass"
    if ok == n:
        return f"{word} {n}/{n}" if n > 1 else word
    return f"{word} {ok}/{n}, untested {n - ok}" if ok else "untested"
