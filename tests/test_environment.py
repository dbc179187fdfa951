"""lmfuse in the environments users run it in: its settings read from environment variables,
an import that leaves Triton alone, no home directory, no Triton, a console that is not
UTF-8."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_cli

import lmfuse
from lmfuse import _launch, demo, tuning

SRC = str(Path(lmfuse.__file__).parents[1])


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter importing this lmfuse, without TRITON_INTERPRET
    unless given."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("TRITON_INTERPRET", "LMFUSE_FAST_LAUNCH")}
    base["PYTHONPATH"] = SRC + os.pathsep + base.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], env=dict(base, **env),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("raw, want", [("", "dflt"), ("1", "on"), (" ON ", "on"),
                                       ("False", "off"), ("no", "off"), ("Check", "check")])
def test_env_setting_words(monkeypatch, raw: str, want: str) -> None:
    monkeypatch.setenv("LMFUSE_TEST_SETTING", raw)
    choices = dict(_launch.ON_OFF, check="check")
    assert _launch.env_setting("LMFUSE_TEST_SETTING", "dflt", choices) == want


def test_env_setting_warns_on_other_values(monkeypatch) -> None:
    monkeypatch.setenv("LMFUSE_TEST_SETTING", "maybe")
    with pytest.warns(UserWarning, match=r"ignoring LMFUSE_TEST_SETTING='maybe' \(expected "
                                         r"one of 1, true, on, yes, 0"):
        assert _launch.env_setting("LMFUSE_TEST_SETTING", "on", _launch.ON_OFF) == "on"


def test_fast_launch_off_in_any_case() -> None:
    run = _python("import lmfuse._launch as L; print(L._ENABLED, L._CHECK)",
                  LMFUSE_FAST_LAUNCH="OFF")
    assert run.returncode == 0 and run.stdout.split() == ["False", "False"], run.stderr
    run = _python("import lmfuse._launch as L; print(L._ENABLED, L._CHECK)",
                  LMFUSE_FAST_LAUNCH="CHECK")
    assert run.returncode == 0 and run.stdout.split() == ["True", "True"], run.stderr


def test_import_leaves_triton_alone() -> None:
    """``import lmfuse`` imports no Triton module (docs/ARCHITECTURE.md): the interpreter can
    still be chosen afterwards, and the CPU ops then run in it."""
    run = _python("import sys, os, torch, lmfuse\n"
                  "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))\n"
                  "os.environ['TRITON_INTERPRET'] = '1'\n"
                  "a = torch.randn(3, 8)\n"
                  "plan = lmfuse.explain(lmfuse.swiglu, a)\n"
                  "ref = torch.nn.functional.silu(a[:, :4]) * a[:, 4:]\n"
                  "print(plan.impl, bool(torch.allclose(lmfuse.swiglu(a), ref, atol=1e-6)))")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[]", "triton True"]


def test_no_home_directory(monkeypatch) -> None:
    """A container's uid with no $HOME and no passwd entry: lmfuse imports and runs without
    a user tuning cache; asking for the cache's path says what to set."""
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv(tuning.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    try:
        tuning.reload()
        with pytest.raises(RuntimeError, match=r"home directory cannot be determined.*"
                                               r"LMFUSE_TUNING_CACHE"):
            tuning.user_cache_path()
        h, w = torch.randn(4, 8), torch.randn(16, 8)
        t = torch.randint(0, 16, (4,))
        loss = lmfuse.linear_cross_entropy(h, w, t)  # reads the tuning tables
        expected = torch.nn.functional.cross_entropy(h @ w.T, t)
        torch.testing.assert_close(loss, expected)
    finally:
        monkeypatch.undo()
        tuning.reload()


def test_info_and_check_without_triton(monkeypatch, capsys) -> None:
    """Where Triton is not installed, TRITON_INTERPRET=1 runs nothing in an interpreter, and
    the verbs say so."""
    from lmfuse import _check, _dispatch, cli

    monkeypatch.setattr(cli, "_best_device", lambda: torch.device("cpu"))  # (a GPU host too)

    def forget_choices() -> None:  # the ops' path choices are cached
        _dispatch._select_cached.cache_clear()
        _dispatch._select_cuda.cache_clear()

    monkeypatch.setattr(_dispatch, "triton_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_check, "run_all", lambda cases: True)  # the header is the point
    forget_choices()
    try:
        code, out, _ = run_cli(capsys, "info")
        assert code == 0
        assert "Triton interpreter (TRITON_INTERPRET=1): off (triton not installed)" in out
        code, out, _ = run_cli(capsys, "check", "--dtypes", "fp32")
        assert code == 0 and out.startswith("lmfuse check on cpu, reference only"), out
    finally:
        monkeypatch.undo()
        forget_choices()


def test_demo_text_on_a_console_that_is_not_utf8(monkeypatch) -> None:
    """The sampled text of a barely trained model has any bytes: printed on a cp1252 console
    it is escaped instead of ending the demo in a UnicodeEncodeError."""
    tokens = list("a\u063a".encode())  # an Arabic letter: no cp1252 encoding
    console = io.TextIOWrapper(io.BytesIO(), encoding="cp1252")
    monkeypatch.setattr(sys, "stdout", console)
    text = demo._text(tokens)
    assert text == "'a\\u063a'"
    print(text)  # what the demo's log does
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    assert demo._text(tokens) == "'a\u063a'"
