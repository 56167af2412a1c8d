"""One opener for every file jaxpar reads: regular files only, a size cap per kind, an open that never blocks.

A FIFO, a device, a socket or a folder given where a file belongs is one line naming the path and the
fix (opening a FIFO blocks until a writer comes, ``/dev/zero`` never ends); a file over its kind's cap
(:data:`CAPS`) is one line stating the cap. The path is checked with ``stat`` first, then opened with
``O_NONBLOCK`` and checked again on the descriptor (``fstat``), so a path swapped for a FIFO in
between still cannot block. Files that are sliced or memory-mapped rather than read whole (weights,
token data) have no cap: :func:`check` only makes sure they are regular files. YAML is loaded
without aliases (:func:`load_yaml`): an alias expands to a copy of its anchor's node, and nested
aliases ("billion laughs") to exponentially many.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from jaxpar.errors import ConfigError

MIB = 1 << 20
MAX_YAML_DEPTH = 100  # nested lists / mappings a YAML file may have
# kind -> the largest such file jaxpar reads whole, in bytes (None: no cap, the file is sliced or mapped)
CAPS: dict[str, int | None] = {
    "config file": 4 * MIB,  # a Python config (configs/*.py are a few kB)
    "optimizer file": 4 * MIB,  # optim.name=path/to/file.py:fn
    "recipe": MIB,  # DeepSpeed JSON, Megatron .args / launch script, torchtitan TOML, accelerate YAML
    "HF config.json": 4 * MIB,
    "weights index": 64 * MIB,  # model.safetensors.index.json: one line per tensor
    "safetensors header": 100_000_000,  # the safetensors format's own limit on its JSON header
    "sweep results": 256 * MIB,  # --baseline: an earlier sweep's results.json
    "run record": 16 * MIB,  # what jaxpar writes in a workdir and reads back: config.json, markers, lock
    "checkpoint metadata": 64 * MIB,  # a checkpoint's meta item (step, data position, config)
    "weights": None,  # safetensors / torch files: read slice by slice
    "checkpoint arrays": None,  # the array files of a checkpoint, read by orbax shard by shard
    "token data": None,  # memory-mapped
    "metrics log": None,  # what jaxpar itself wrote: metrics.jsonl, TensorBoard events, the drill's run logs
}
_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


def size_text(n: float) -> str:
    """``4 MiB``, ``1.5 GiB``, ``100 MB`` (the safetensors limit is decimal)."""
    if n % 1_000_000 == 0 and n % MIB:
        return f"{n / 1e6:g} MB"
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} bytes"


def _name(path: Any) -> str:
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)
    return text if len(text) <= 200 else text[:200] + "..."


def _refuse_kind(st: os.stat_result, path: Any, kind: str, what: str, fix: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        shape = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise ConfigError(f"{what}: '{_name(path)}' is {shape}, not a regular file; {fix}")
    cap = CAPS[kind]
    if cap is not None and st.st_size > cap:
        raise ConfigError(
            f"{what}: '{_name(path)}' is {size_text(st.st_size)}, more than a {kind} may be ({size_text(cap)}); {fix}"
        )


def _os_error(error: OSError | ValueError, path: Any, what: str, fix: str) -> ConfigError:
    if isinstance(error, FileNotFoundError):
        return ConfigError(f"{what}: file '{_name(path)}' not found; {fix}")
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return ConfigError(f"{what}: cannot read '{_name(path)}' ({reason}); {fix}")


def check(path: Any, kind: str, what: str, fix: str) -> os.stat_result:
    """The ``stat`` of ``path``, a regular file within its kind's cap; else a one-line ConfigError that
    names ``what`` (the flag or field that gave the path), the path and ``fix``."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise _os_error(e, path, what, fix) from None
    _refuse_kind(st, path, kind, what, fix)
    return st


def is_file(path: Any) -> bool:
    """Whether ``path`` exists and is a regular file (False for a path the OS refuses)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def read_bytes(path: Any, kind: str, what: str, fix: str) -> bytes:
    """The bytes of the regular file ``path`` (at most its kind's cap), read without ever blocking on open."""
    check(path, kind, what, fix)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as e:
        raise _os_error(e, path, what, fix) from None
    try:
        st = os.fstat(fd)
        _refuse_kind(st, path, kind, what, fix)  # swapped since the stat: refused all the same
        cap = CAPS[kind]
        chunks, total = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            total += len(chunk)
            if cap is not None and total > cap:  # grew since the fstat
                raise ConfigError(
                    f"{what}: '{_name(path)}' grew past {size_text(cap)}, more than a {kind} may be; {fix}"
                )
        return b"".join(chunks)
    except OSError as e:
        raise _os_error(e, path, what, fix) from None
    finally:
        os.close(fd)


def read_head(path: Any, kind: str, what: str, fix: str, size: int) -> bytes:
    """The first ``size`` bytes of the regular file ``path`` (a file header), read without blocking."""
    check(path, kind, what, fix)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as e:
        raise _os_error(e, path, what, fix) from None
    try:
        _refuse_kind(os.fstat(fd), path, kind, what, fix)
        return os.read(fd, size)
    except OSError as e:
        raise _os_error(e, path, what, fix) from None
    finally:
        os.close(fd)


def check_tree(folder: Any, what: str, fix: str, kind_of: Any) -> None:
    """Every entry under ``folder`` is a folder or a regular file within the cap of ``kind_of(relative
    path)``: what a reader that opens the files itself (orbax, tensorstore) will find there."""
    for root, _dirs, names in os.walk(folder):  # links to folders are not followed
        for name in names:
            path = os.path.join(root, name)
            check(path, kind_of(os.path.relpath(path, folder)), what, fix)


def read_text(path: Any, kind: str, what: str, fix: str) -> str:
    """:func:`read_bytes` decoded as UTF-8; bytes that are not UTF-8 are one line naming the offset."""
    data = read_bytes(path, kind, what, fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what}: '{_name(path)}' is not UTF-8 text (byte {e.start}: {e.reason}); {fix}") from None


def load_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load(text)`` refusing aliases (``*name``): an alias repeats its anchor's node, and
    aliases of aliases grow exponentially; a config needs none. Raises ``yaml.YAMLError`` for bad syntax."""
    import yaml

    if hasattr(yaml, "CSafeLoader"):  # libyaml: the same YAML, about 20x faster than the Python reader
        depth = 0
        try:
            for event in yaml.parse(text, Loader=yaml.CSafeLoader):
                if isinstance(event, yaml.AliasEvent):
                    _refuse_alias(event, what)
                depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
                if depth > MAX_YAML_DEPTH:  # libyaml slows with the square of the depth; a config nests a few
                    raise _too_deep(what, event.start_mark)
        except yaml.YAMLError as e:  # newer libyaml stops at 1000 levels itself, before the events reach 101
            if "maximum nesting depth" in str(e):
                raise _too_deep(what, e.problem_mark) from None
            raise
        return yaml.load(text, Loader=yaml.CSafeLoader)  # noqa: S506 - the safe loader, in C

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                _refuse_alias(self.peek_event(), what)
            return super().compose_node(parent, index)

    loader = NoAliases(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _too_deep(what: str, mark: Any) -> ConfigError:
    line = f" (line {mark.line + 1})" if mark is not None else ""
    return ConfigError(
        f"{what}: the YAML nests more than {MAX_YAML_DEPTH} levels deep{line}; a config needs a few, write it flatter"
    )


def _refuse_alias(event: Any, what: str) -> None:
    raise ConfigError(
        f"{what}: YAML alias *{event.anchor} (line {event.start_mark.line + 1}): jaxpar reads YAML "
        "without anchors and aliases; write the value out in place"
    )
