"""The user's contexts file: written and read back exactly, hostile text included, and the
precedence flags > environment > current context."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gpupool.cli.main import app
from gpupool.client import config
from gpupool.client.sdk import resolve_token, resolve_url

NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=60)
PATHS = TEXT.filter(lambda t: t != "~" and not t.startswith("~/"))
"""Path texts that are not the home forms, which load expands (test below)."""


@settings(max_examples=60, deadline=None)
@given(name=NAMES, url=TEXT, token_file=PATHS, data_dir=PATHS)
def test_a_context_is_read_back_as_written_whatever_its_text(
    tmp_path_factory: pytest.TempPathFactory, name: str, url: str, token_file: str, data_dir: str
) -> None:
    path = tmp_path_factory.mktemp("cfg") / "config.toml"
    made = config.Context(name, url, Path(token_file), Path(data_dir))
    config.record(made, path=path)
    loaded = config.load(path)
    assert loaded.current == name
    back = loaded.contexts[name]
    assert (back.url, back.token_file, back.data_dir) == (url, Path(token_file), Path(data_dir))


def test_home_in_a_context_path_is_the_users_and_other_tildes_are_text(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    config.record(config.Context("a", "http://x", Path("~/t"), Path("~nosuchuser/d")), path=path)
    back = config.load(path).contexts["a"]
    assert back.token_file == Path.home() / "t"
    assert back.data_dir == Path("~nosuchuser/d")


def test_the_file_is_private_and_a_second_context_is_added_beside_the_first(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sub" / "config.toml"
    config.record(config.Context("a", "http://127.0.0.1:1"), path=path)
    config.record(config.Context("b", "http://127.0.0.1:2"), path=path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded = config.load(path)
    assert sorted(loaded.contexts) == ["a", "b"] and loaded.current == "b"
    config.use("a", path=path)
    assert config.load(path).current == "a"


@pytest.mark.parametrize("name", ["", "-x", "a b", "a\nb", "x" * 65, 'q"'])
def test_a_bad_context_name_is_refused_with_the_rule(tmp_path: Path, name: str) -> None:
    with pytest.raises(config.ConfigError, match="context name must be"):
        config.record(config.Context(name, "http://h"), path=tmp_path / "c.toml")


def test_a_broken_file_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.toml"
    path.write_text("current-context = [\n")
    monkeypatch.setenv(config.CONFIG_ENV, str(path))
    monkeypatch.delenv("GPUPOOL_URL", raising=False)
    result = CliRunner().invoke(app, ["gpus"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "not valid TOML" in lines[0]


def test_flags_beat_the_environment_which_beats_the_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.toml"
    token_file = tmp_path / "admin.token"
    token_file.write_text("gpp_from_context\n")
    monkeypatch.setenv(config.CONFIG_ENV, str(path))
    monkeypatch.delenv("GPUPOOL_URL", raising=False)
    monkeypatch.delenv("GPUPOOL_TOKEN", raising=False)
    monkeypatch.delenv("GPUPOOL_TOKEN_FILE", raising=False)
    config.record(config.Context("pool", "http://10.0.0.1:8900", token_file))
    assert resolve_url(None) == "http://10.0.0.1:8900"
    assert resolve_token("http://10.0.0.1:8900") == "gpp_from_context"
    assert resolve_token("http://10.0.0.2:8900") is None, "never sent to another pool"
    monkeypatch.setenv("GPUPOOL_URL", "http://10.0.0.3:8900")
    assert resolve_url(None) == "http://10.0.0.3:8900"
    assert resolve_url("http://10.0.0.4:8900") == "http://10.0.0.4:8900"
    monkeypatch.setenv("GPUPOOL_TOKEN", "gpp_from_env")
    assert resolve_token("http://10.0.0.1:8900") == "gpp_from_env"
    assert resolve_token("http://10.0.0.1:8900", "gpp_flag") == "gpp_flag"


def test_context_shows_where_url_and_token_come_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.toml"
    monkeypatch.setenv(config.CONFIG_ENV, str(path))
    monkeypatch.delenv("GPUPOOL_URL", raising=False)
    monkeypatch.delenv("GPUPOOL_TOKEN", raising=False)
    none = CliRunner().invoke(app, ["context"])
    assert none.exit_code == 0 and "no current context" in none.stdout
    config.record(config.Context("lab", "http://10.1.1.1:8900", tmp_path / "t"))
    shown = CliRunner().invoke(app, ["context"])
    assert "current context: lab" in shown.stdout
    assert "url: http://10.1.1.1:8900 (from context 'lab')" in shown.stdout
    flagged = CliRunner().invoke(app, ["--url", "http://h:1", "context"])
    assert "url: http://h:1 (from --url)" in flagged.stdout
    listed = CliRunner().invoke(app, ["context", "ls"])
    assert "lab" in listed.stdout and "*" in listed.stdout
