"""The partner conformance suite: checks every contract hook of a backend against core's reference ops.

``run_conformance("mydevice", report_dir="out")`` returns a :class:`Report` (``.status`` PASS / PARTIAL / FAIL, a
verification level, support matrix as markdown, JSON, CSV); ``pagedllm conformance --device mydevice``
and ``pytest --pyargs pagedllm.conformance --conformance-device mydevice`` run the same cases. ``pagedllm conformance
--support-matrix docs/support-matrix.md --from-reports *.json`` builds the project's matrix (docs/conformance.md).
Cases come only from what the backend's Capabilities declare (what it does not declare is listed not applicable,
with the reason, never run); cases that ran only core's reference code count as reference fallback, apart from the
backend's verified features. Partners narrow or relax them with allowlists, exclusions and tolerance overrides, like
PyTorch's device-generic tests for PrivateUse1 backends.
"""

from pagedllm.conformance.report import (FAIL, HARDWARE, NOT_VERIFIED, PARTIAL, PASS, REFERENCE_FALLBACK, SIMULATION,
                                         CaseResult, Report)
from pagedllm.conformance.runner import (DEFAULT_TOLERANCES, SIMULATED_ENV, enumerate_cases, run_case,
                                         run_conformance)

__all__ = ["run_conformance", "Report", "CaseResult", "DEFAULT_TOLERANCES", "enumerate_cases", "run_case",
           "PASS", "PARTIAL", "FAIL", "HARDWARE", "SIMULATION", "NOT_VERIFIED", "REFERENCE_FALLBACK", "SIMULATED_ENV"]
