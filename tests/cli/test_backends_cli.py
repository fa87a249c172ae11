"""``pagedllm backends``: every backend of the project is listed with a reason, and piping into ``head`` is quiet."""

import json
import subprocess
import sys

import pytest

from pagedllm.backend import registry as backends
from pagedllm.commands import backends as cmd

ALL = {"cpu", "cuda", "rocm", "xpu", "ascend", "gaudi", "tpu"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.cli", "backends", *args], capture_output=True, text=True,
                          timeout=120)


def test_lists_every_backend_with_a_reason():
    rows = {r["name"]: r for r in json.loads(_cli("--json").stdout)}
    assert ALL <= set(rows)
    assert rows["cpu"]["usable"]
    for name in ALL - {"cpu"}:  # no accelerator here: each says why in one line
        assert not rows[name]["usable"] and rows[name]["reason"] and "\n" not in rows[name]["reason"], rows[name]


def test_an_extra_not_installed_says_how_to_get_it(monkeypatch):
    real = backends.discover()
    monkeypatch.setattr(backends, "discover", lambda refresh=False: {k: v for k, v in real.items() if k != "gaudi"})
    row = {r["name"]: r for r in cmd.rows()}["gaudi"]
    assert not row["usable"] and row["reason"] == 'not installed: pip install "pagedllm[gaudi]"'


def test_reader_leaving_early_is_not_an_error():
    """`pagedllm backends | head -1`: the reader closes the pipe before we write; no BrokenPipeError traceback."""
    p = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "backends"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) in (0, 141) and "Traceback" not in err and "BrokenPipe" not in err, err


def test_device_without_its_plugin_names_the_extra(monkeypatch):
    real = backends.discover()
    monkeypatch.setattr(backends, "discover", lambda refresh=False: {k: v for k, v in real.items() if k != "cuda"})
    with pytest.raises(backends.BackendError, match=r"pip install pagedllm\[cuda\]"):
        backends.get_backend("cuda")


def test_lists_only_backends_within_100_columns():
    """The `bench` and `ray` extras are not backends: they are not listed as missing ones; the table fits 100
    columns (long reasons wrap under their column)."""
    p = _cli()
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    names = {line.split()[0] for line in lines[1:] if not line.startswith(" ")}
    assert ALL <= names and not names & {"bench", "ray", "serve", "dev"}, names
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    rows = {r["name"] for r in json.loads(_cli("--json").stdout)}
    assert not rows & {"bench", "ray", "serve", "dev"}
    assert "bench" not in backends.known_extras() and "cpu" in backends.known_extras()
