"""The partner conformance suite: checks every contract hook of a backend against core's reference ops.

``run_conformance("cuda", report_dir="out")`` returns a :class:`Report` (support matrix as markdown, JSON, CSV);
``pagedllm conformance --device cuda`` and ``pytest --pyargs pagedllm.conformance --device cuda`` run the same cases.
Cases come only from what the backend's Capabilities declare; partners narrow or relax them with allowlists,
exclusions and tolerance overrides, like PyTorch's device-generic tests for PrivateUse1 backends.
"""

from pagedllm.conformance.report import CaseResult, Report
from pagedllm.conformance.runner import DEFAULT_TOLERANCES, enumerate_cases, run_case, run_conformance

__all__ = ["run_conformance", "Report", "CaseResult", "DEFAULT_TOLERANCES", "enumerate_cases", "run_case"]
