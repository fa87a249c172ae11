"""One pytest test per conformance case; options and fixtures come from ``pagedllm.conformance.pytest_plugin``."""

from __future__ import annotations

import pytest

from pagedllm.conformance.report import CaseResult
from pagedllm.conformance.runner import Case, run_case, selection_reason


def test_conformance(conformance_backend, conformance_case: Case, conformance_selection, conformance_results):
    case = conformance_case
    reason = selection_reason(case, *conformance_selection)
    if reason:
        result = CaseResult(case.feature, case.kernel, case.model, case.dtype, "untested", reason,
                            not_applicable=bool(case.untested))
    else:
        result = run_case(conformance_backend, case)
    conformance_results.append(result)
    if result.status == "untested":
        pytest.skip(result.error)
    assert result.status == "passing", result.error
