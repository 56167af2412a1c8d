"""Loading a config: a ``--config`` file run in a child process (:mod:`jaxpar.isolated`) and kept per
process for the same bytes, merged on the defaults (unknown and moved keys refused), then the
``--config.x.y=v`` overrides, typed by the field they set; :func:`load_config` ends by validating."""

from __future__ import annotations

import copy
import difflib
import hashlib
import importlib.util
import inspect
import os
import pathlib
import stat
from typing import Any

from jaxpar import files, isolated
from jaxpar.acts import flatten
from jaxpar.config.moved import REMOVED_SECTIONS, moved_key_error
from jaxpar.config.schema import ConfigDict, default_config
from jaxpar.config.validation import validate
from jaxpar.errors import ConfigError
from jaxpar.layout import ParallelLayout


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> ConfigDict:
    """Load ``get_config()`` from a config file, apply ``--config.x.y=v`` overrides, validate.

    ``path`` may carry an argument after a colon (``configs/x.py:arg``), passed to
    ``get_config(arg)`` as ml_collections does.
    """
    return load_config_and_layout(path, overrides)[0]


def load_config_and_layout(
    path: str | None, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[ConfigDict, ParallelLayout]:
    """:func:`load_config` and the layout :func:`validate` built: what a run (``jaxpar train``,
    ``inspect``) hands down instead of deriving it from the config again."""
    cfg = default_config() if path is None else _load_file(path)
    apply_overrides(cfg, overrides)
    return cfg, validate(cfg)


CONFIG_TIMEOUT_S = 30  # default of JAXPAR_CONFIG_TIMEOUT: how long a config file may take to load


# The values of config files this process ran, by (real path, argument, SHA-256 of the file's bytes):
# a file is run once per process for the same bytes (a fresh interpreter per run costs ~0.1-0.3 s once
# JAX has started). Only what the file itself holds is in the key: a module it imports is not.
_VALUES: dict[tuple[str, str, str], dict[str, Any]] = {}
_CACHED_BYTES = 1 << 20  # files larger than this are run every time (the child's reader refuses them anyway)


def _cache_key(spec: str) -> tuple[str, str, str] | None:
    """The file's key in :data:`_VALUES`, or None where only the child should look at it (not a
    regular file, too large, unreadable): opened without blocking, so a FIFO cannot hang the caller."""
    path_str, _, arg = spec.partition(":")
    try:
        fd = os.open(path_str, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, ValueError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _CACHED_BYTES:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(_CACHED_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return os.path.realpath(path_str), arg, hashlib.sha256(data).hexdigest()


def _load_file(spec: str) -> ConfigDict:
    """The config file ``spec`` run in a child process (:mod:`jaxpar.isolated`): a file that loops, starts
    a thread or ends the interpreter cannot hang or end the caller; only its values come back (and are
    kept for the same bytes: :data:`_VALUES`)."""
    path_str = spec.partition(":")[0]
    limit = os.environ.get("JAXPAR_CONFIG_TIMEOUT", str(CONFIG_TIMEOUT_S))
    if not (limit.isascii() and limit.isdigit() and int(limit) >= 1):
        raise ConfigError(f"JAXPAR_CONFIG_TIMEOUT={limit!r}: use a whole number of seconds of at least 1")
    key = _cache_key(spec)
    if key is not None and key in _VALUES:
        return merge_into_defaults(copy.deepcopy(_VALUES[key]), source=path_str)
    values = isolated.call(
        __name__,
        "config_file_values",
        [spec],
        int(limit),
        f"--config: '{path_str[:200]}'",
        "a config file only builds its ConfigDict (no loops, threads or waiting); "
        "raise JAXPAR_CONFIG_TIMEOUT if it needs longer",
    )
    if key is not None:
        _VALUES[key] = copy.deepcopy(values)
    return merge_into_defaults(values, source=path_str)


def config_file_values(spec: str) -> dict[str, Any]:
    """The flat ``{"section.field": value}`` of the config file ``spec``, run in this process (the child
    :func:`_load_file` starts): plain values, sent back as JSON."""
    return flatten(_run_file(spec).to_dict())


def _run_file(spec: str) -> ConfigDict:
    path_str, _, arg = spec.partition(":")
    path = pathlib.Path(path_str)
    fix = "pass a path such as configs/tiny.py"
    if not _exists(path):
        raise ConfigError(f"--config: file '{path_str[:200]}' not found; {fix}")
    files.check(path, "config file", "--config", fix)  # a FIFO, device or folder: one line, no hang
    module_spec = importlib.util.spec_from_file_location(f"jaxpar_config_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"--config: '{path_str}' is not a Python file; pass a .py file defining get_config()")
    source = files.read_bytes(path, "config file", "--config", fix)
    module = importlib.util.module_from_spec(module_spec)
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)  # the bytes read above, not a second open
    except BaseException as e:  # a broken config file is bad input, not a crash (SystemExit included)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ConfigError(f"--config: '{path_str}' failed to load ({_first_line(e)})") from e
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(f"--config: '{path_str}' defines no get_config(); add one returning a ConfigDict")
    args = (arg,) if arg else ()
    try:
        inspect.signature(get_config).bind(*args)
    except (TypeError, ValueError):
        want = "get_config(arg)" if arg else "get_config()"
        raise ConfigError(
            f"--config: '{path_str}': get_config does not accept the call {want}; "
            + ("drop ':" + arg + "' from --config" if arg else "give its argument as --config FILE:ARG")
        ) from None
    try:
        cfg = get_config(*args)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ConfigError(f"--config: '{path_str}': get_config() raised {_first_line(e)}; fix the config file") from e
    if not isinstance(cfg, (ConfigDict, dict)):
        raise ConfigError(
            f"--config: '{path_str}': get_config() returned {type(cfg).__name__}, not a ConfigDict; "
            "return jaxpar.config.default_config() with your changes"
        )
    return merge_into_defaults(cfg, source=path_str)


def _exists(path: pathlib.Path) -> bool:
    """``path.exists()``, False for a name the OS refuses (too long, a NUL byte) instead of raising."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _first_line(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0][:200]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def merge_into_defaults(cfg: ConfigDict | dict, source: str = "config") -> ConfigDict:
    """Overlay a (possibly partial) config on the defaults, rejecting unknown keys."""
    base = default_config()
    try:
        flat = flatten(cfg.to_dict() if isinstance(cfg, ConfigDict) else cfg)
    except RecursionError:
        raise ConfigError(f"{source}: the config nests too deeply; use section.field keys") from None
    for key, value in flat.items():
        _set(base, key, value, origin=source)
    for section in REMOVED_SECTIONS:  # an empty section flattens to no key
        if section in cfg:
            raise ConfigError(
                f"{source}: the {section} section is gone (its fields moved to parallel); drop c.{section} and set "
                "the parallel.* fields: see jaxpar/config/schema.py"
            )
    return base


def apply_overrides(cfg: ConfigDict, overrides: list[str] | tuple[str, ...]) -> None:
    """Apply ``--config.a.b=value`` strings, typed by the existing field."""
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if not text.startswith("config.") or "=" not in text:
            raise ConfigError(f"override '{item}': expected --config.<section>.<field>=<value>")
        key, _, raw = text[len("config.") :].partition("=")
        _set(cfg, key, raw, origin=f"--config.{key}", parse=True)


def _known_keys() -> list[str]:
    return sorted(flatten(default_config().to_dict()))


def _set(cfg: ConfigDict, key: str, value: Any, origin: str, parse: bool = False) -> None:
    moved = moved_key_error(key, value, origin)
    if moved is not None:
        raise ConfigError(moved)
    parts = key.split(".")
    node = cfg
    for part in parts[:-1]:
        if part not in node or not isinstance(node[part], ConfigDict):
            raise ConfigError(_unknown(key, origin))
        node = node[part]
    leaf = parts[-1]
    if leaf not in node or isinstance(node[leaf], ConfigDict):
        raise ConfigError(_unknown(key, origin))
    current = node[leaf]
    node[leaf] = _coerce(value, current, key, parse)


def _unknown(key: str, origin: str) -> str:
    close = difflib.get_close_matches(key, _known_keys(), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; see jaxpar/config/schema.py for the fields"
    return f"{origin}: unknown config key '{key}'{hint}"


def _coerce(value: Any, current: Any, key: str, parse: bool) -> Any:
    kind = type(current)
    if parse and isinstance(value, str):
        raw = value.strip()
        try:
            if kind is bool:
                low = raw.lower()
                if low in ("true", "1", "yes"):
                    return True
                if low in ("false", "0", "no"):
                    return False
                raise ValueError
            if kind is int:
                return int(raw)
            if kind is float:
                return float(raw)
        except ValueError:
            raise ConfigError(
                f"--config.{key}: '{raw}' is not a valid {kind.__name__}; give e.g. --config.{key}={current!r}"
            ) from None
        return raw
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, (int, float)) and key == "train.resume":
        return str(value)
    if type(value) is not kind:
        raise ConfigError(f"config.{key}: expected {kind.__name__}, got {value!r}; fix the value in the config")
    return value
