"""The conformance report: one row per case, rendered as a support matrix (markdown), JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

STATUSES = ("passing", "failing", "untested")
#: A whole run: FAIL (a case failed), PARTIAL (nothing failed, but a case the backend declares was not run), PASS.
PASS, PARTIAL, FAIL = "PASS", "PARTIAL", "FAIL"
#: How a passing feature was verified (``Report.verification``); a feature not run or failing is not verified.
HARDWARE, SIMULATION, NOT_VERIFIED = "verified-on-hardware", "verified-on-CPU-simulation", "not-verified"


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
    #: HARDWARE when run on the backend's real device, SIMULATION under a simulated device layer
    verification: str = HARDWARE
    simulated: str = ""  # what simulated the device, when verification is SIMULATION

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
        passed, else :data:`NOT_VERIFIED` (never claimed for a case that was not run)."""
        out: dict[str, str] = {}
        for feature in dict.fromkeys(r.feature for r in self.results):
            rows = [r for r in self.results if r.feature == feature and not r.not_applicable]
            ok = bool(rows) and all(r.status == "passing" for r in rows)
            out[feature] = self.verification if ok else NOT_VERIFIED
        return out

    @property
    def failing(self) -> list[CaseResult]:
        return [r for r in self.results if r.status == "failing"]

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    # ---- renderings ------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"backend": self.backend, "device": self.device, "status": self.status,
                           "verification": self.verification, "simulated": self.simulated,
                           "features": self.features(), "environment": self.environment,
                           "counts": self.counts(), "results": [asdict(r) for r in self.results]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Report":
        d = json.loads(text)
        known = set(CaseResult.__dataclass_fields__)
        return cls(d["backend"], d["device"], [CaseResult(**{k: v for k, v in r.items() if k in known})
                                              for r in d["results"]],
                   d.get("environment", {}), d.get("verification", HARDWARE), d.get("simulated", ""))

    def to_csv(self) -> str:
        buf = io.StringIO()
        names = ["feature", "kernel", "model", "dtype", "status", "max_abs_err", "seconds", "error", "detail"]
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
        na = sum(r.not_applicable for r in self.results)
        lines = [f"# Conformance: backend `{self.backend}` ({self.device})", "",
                 f"**{self.status}**: {c['passing']} passing, {c['failing']} failing, "
                 f"{c['untested']} untested ({na} not applicable: capabilities rule them out).", "",
                 f"Verification: {self.verification}" + (f" ({self.simulated})" if self.simulated else ""), ""]
        if self.environment:
            lines += [", ".join(f"{k}: {v}" for k, v in self.environment.items()), ""]
        dtypes, cells = self.matrix()
        lines += ["| feature | kernel | " + " | ".join(dtypes) + " |", "|---|---|" + "---|" * len(dtypes)]
        for (feature, kernel), by_dtype in cells.items():
            row = [feature, kernel] + [_cell(by_dtype.get(d, [])) for d in dtypes]
            lines.append("| " + " | ".join(row) + " |")
        for title, status in (("Failing", "failing"), ("Untested", "untested")):
            rows = [r for r in self.results if r.status == status]
            if rows:
                lines += ["", f"## {title}", ""]
                lines += [f"- `{r.id}`: {r.error.splitlines()[0] if r.error else ''}" for r in rows]
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
    if ok == n:
        return f"pass {n}/{n}" if n > 1 else "pass"
    return f"pass {ok}/{n}, untested {n - ok}" if ok else "untested"
