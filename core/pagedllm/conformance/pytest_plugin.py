"""pytest plugin behind ``pytest --pyargs pagedllm.conformance --conformance-device NAME``: one test per case.

pytest reads command-line options only from plugins and from conftest files next to *path* arguments, never from a
``--pyargs`` package, so this module is registered as a plugin: through the ``pytest11`` entry point of the pagedllm
distribution, or explicitly with ``-p pagedllm.conformance.pytest_plugin``. It only adds options and acts on tests
asking for the ``conformance_case`` fixture, so it is inert in other test suites; every option it adds is named
``--conformance-*`` so it never claims a generic name (``--device``) in someone else's pytest run.
"""

from __future__ import annotations

import os

import pytest

_results: list = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedllm-conformance")
    group.addoption("--conformance-device", default=None, metavar="NAME",
                    help="pagedllm backend to check (a name from `pagedllm backends`)")
    group.addoption("--conformance-allow", action="append", default=[], metavar="PATTERN",
                    help="run only matching cases (case id kernel[model|dtype], kernel or feature; * and ?)")
    group.addoption("--conformance-exclude", action="append", default=[], metavar="PATTERN",
                    help="report matching cases as untested")
    group.addoption("--conformance-report", default=None, metavar="DIR",
                    help="write the support matrix (md, json, csv) here")


def _backend(config: pytest.Config):
    from pagedllm.backend.registry import get_backend  # heavy: torch, not at pytest start

    name = config.getoption("--conformance-device")
    if not name:
        raise pytest.UsageError("pagedllm.conformance needs --conformance-device NAME (see `pagedllm backends`)")
    return get_backend(name)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_case" in metafunc.fixturenames:
        from pagedllm.conformance.runner import enumerate_cases  # heavy: torch, not at pytest start

        cases = enumerate_cases(_backend(metafunc.config))
        metafunc.parametrize("conformance_case", cases, ids=[c.id for c in cases])


@pytest.fixture(scope="session")
def conformance_backend(request: pytest.FixtureRequest):
    return _backend(request.config)


@pytest.fixture(scope="session")
def conformance_selection(request: pytest.FixtureRequest) -> tuple[list[str], list[str]]:
    return request.config.getoption("--conformance-allow"), request.config.getoption("--conformance-exclude")


@pytest.fixture(scope="session")
def conformance_results() -> list:
    return _results


def pytest_sessionfinish(session: pytest.Session) -> None:
    report_dir = session.config.getoption("--conformance-report", None)
    if report_dir and _results:
        from pagedllm.conformance.report import Report  # heavy: torch, not at pytest start

        backend = _backend(session.config)
        from pagedllm.conformance.evidence import device_evidence  # heavy: torch, not at pytest start
        from pagedllm.conformance.report import NOT_VERIFIED, SIMULATION
        from pagedllm.conformance.runner import SIMULATED_ENV

        report = Report(backend.name, str(backend.device()), list(_results))
        if os.environ.get(SIMULATED_ENV):
            report.verification, report.simulated = SIMULATION, os.environ[SIMULATED_ENV]
        else:  # "on hardware" only with evidence of the device
            real, report.evidence = device_evidence(backend)
            report.verification = report.verification if real else NOT_VERIFIED
        report.write(report_dir)
