"""The user's pools, kubectl-like: named contexts (url, token file) and the current one.

`gpupool up` records the pool it starts here, so that every command, the SDK and programs
run under `gpupool run` find the pool and its token from any directory. The file is
`~/.config/gpupool/config.toml`, or the one `$GPUPOOL_CONFIG` names:

    current-context = "local"

    [contexts.local]
    url = "http://127.0.0.1:8900"
    token-file = "/home/me/.gpupool/admin.token"
    data-dir = "/home/me/.gpupool"
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_ENV = "GPUPOOL_CONFIG"
DEFAULT_CONFIG = Path("~/.config/gpupool/config.toml")
NAME_MAX = 64
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(ValueError):
    """The config file cannot be read or written, or a context is wrong; the text says why."""


@dataclass(frozen=True, slots=True)
class Context:
    """One pool the user talks to: where it answers, where its token is, and (for a pool
    `gpupool up` started) the data dir that `gpupool down` finds its processes by."""

    name: str
    url: str
    token_file: Path | None = None
    data_dir: Path | None = None

    def token(self) -> str | None:
        """The token in `token_file`, or None when there is none (or it cannot be read)."""
        if self.token_file is None:
            return None
        try:
            text = self.token_file.read_text().strip()
        except OSError:
            return None
        return text or None


@dataclass(slots=True)
class Config:
    contexts: dict[str, Context] = field(default_factory=dict)
    current: str | None = None

    def current_context(self) -> Context | None:
        return self.contexts.get(self.current) if self.current else None


def config_path() -> Path:
    named = os.environ.get(CONFIG_ENV, "").strip()
    return Path(named).expanduser() if named else DEFAULT_CONFIG.expanduser()


def check_name(name: str) -> str:
    """A context name: letters, digits, '_', '.', '-' (it is a TOML key and a word in a shell)."""
    if not name or len(name) > NAME_MAX or not _NAME.match(name):
        raise ConfigError(
            f"context name must be 1..{NAME_MAX} letters, digits, '_', '.' or '-' "
            "(starting with a letter or digit)"
        )
    return name


def load(path: Path | None = None) -> Config:
    """The config file's contexts; an absent file is an empty config."""
    path = path or config_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Config()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return _parse(data, path)


def _parse(data: dict[str, object], path: Path) -> Config:
    contexts: dict[str, Context] = {}
    table = data.get("contexts", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: 'contexts' must be a table of [contexts.NAME]")
    for name, entry in table.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise ConfigError(f'{path}: context {name!r} needs a url = "http://..."')
        token_file = entry.get("token-file")
        data_dir = entry.get("data-dir")
        if token_file is not None and not isinstance(token_file, str):
            raise ConfigError(f"{path}: context {name!r}: token-file must be a path")
        if data_dir is not None and not isinstance(data_dir, str):
            raise ConfigError(f"{path}: context {name!r}: data-dir must be a path")
        contexts[name] = Context(
            name=name,
            url=entry["url"],
            token_file=_home_path(token_file) if token_file else None,
            data_dir=_home_path(data_dir) if data_dir else None,
        )
    current = data.get("current-context")
    if current is not None and not isinstance(current, str):
        raise ConfigError(f"{path}: current-context must be a context's name")
    return Config(contexts=contexts, current=current or None)


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = ['"']
    for char in text:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def dumps(config: Config) -> str:
    lines = ["# gpupool contexts: `gpupool context ls`, `gpupool context use NAME`."]
    if config.current:
        lines.append(f"current-context = {_toml_string(config.current)}")
    for name in sorted(config.contexts):
        context = config.contexts[name]
        lines += ["", f"[contexts.{_toml_string(name)}]", f"url = {_toml_string(context.url)}"]
        if context.token_file is not None:
            lines.append(f"token-file = {_toml_string(str(context.token_file))}")
        if context.data_dir is not None:
            lines.append(f"data-dir = {_toml_string(str(context.data_dir))}")
    return "\n".join(lines) + "\n"


def save(config: Config, path: Path | None = None) -> Path:
    """Write the config atomically (a reader never sees half a file), readable by its owner only:
    it names where admin tokens are."""
    path = path or config_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(dumps(config))
        os.replace(temp, path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from None
    return path


def record(context: Context, make_current: bool = True, path: Path | None = None) -> Path:
    """Add or replace one context (and make it the current one): what `gpupool up` does."""
    check_name(context.name)
    config = load(path)
    config.contexts[context.name] = context
    if make_current:
        config.current = context.name
    return save(config, path)


def use(name: str, path: Path | None = None) -> Context:
    check_name(name)
    config = load(path)
    if name not in config.contexts:
        known = ", ".join(sorted(config.contexts)) or "none yet (`gpupool up` makes one)"
        raise ConfigError(f"no context named {name!r}; contexts: {known}")
    config.current = name
    save(config, path)
    return config.contexts[name]


def current() -> Context | None:
    """The current context, or None when there is none (no file, or none chosen); a file that
    cannot be read raises ConfigError, because silently using another pool would be worse."""
    return load().current_context()


def context_for(url: str) -> Context | None:
    """The context whose pool answers at `url`: the current one first, then any other, so that
    `--url` or $GPUPOOL_URL naming a known pool still finds that pool's token (and a token is
    never sent to a pool it does not belong to)."""
    config = load()
    chosen = config.current_context()
    if chosen is not None and _same_url(chosen.url, url):
        return chosen
    for context in config.contexts.values():
        if _same_url(context.url, url):
            return context
    return None


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/").lower() == b.rstrip("/").lower()


def _home_path(text: str) -> Path:
    """A path of the file: `~` and `~/...` are the user's home, as a shell reads them; any
    other text, `~name` included, is taken as written (pathlib would look `name` up as a
    user and raise where there is none: a config file must load whatever it holds)."""
    if text == "~" or text.startswith("~/"):
        return Path(text).expanduser()
    return Path(text)
