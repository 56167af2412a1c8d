"""The one guard for every path jaxpar writes: nothing is deleted or overwritten that jaxpar did not create.

- A folder jaxpar creates (a workdir, an export, a sweep's output, a drill's runs) holds a marker,
  :data:`MARKER`: JSON naming the kind of folder and the entries jaxpar put there. It is replaced
  only when it holds a marker of the same kind and nothing the marker does not list.
- A file jaxpar writes (``port -o``) is replaced only when its first bytes carry jaxpar's signature
  (:func:`write_file`'s ``owned``).
- An output may not be or contain an input or a run's workdir (:func:`check_apart`).
- Replacing writes a temporary sibling and renames it into place, so a failure (a full disk) leaves
  the previous output as it was; an :class:`OSError` names the path (:func:`naming`).

Every refusal is a :class:`~jaxpar.errors.ConfigError` naming the flag or field, the path and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator

from jaxpar import files
from jaxpar.errors import ConfigError

MARKER = ".jaxpar"  # in every folder jaxpar creates
EXPORT, SWEEP, WORKDIR = "export", "sweep", "workdir"  # the kinds of folder jaxpar makes
PathLike = str | os.PathLike


def real(path: PathLike) -> pathlib.Path:
    """``path`` absolute, with its links resolved (two names of one folder compare equal)."""
    return pathlib.Path(os.path.realpath(os.fspath(path)))


def read_marker(folder: PathLike) -> dict | None:
    """The marker of ``folder`` (``{"kind": ..., "entries": [...]}``), or None when it has none."""
    path = pathlib.Path(folder) / MARKER
    if path.is_symlink():
        return None
    try:
        marker = json.loads(files.read_text(path, "run record", "marker", ""))
    except (ConfigError, ValueError, RecursionError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("kind"), str) else None


def mark(folder: PathLike, kind: str, entries: Iterable[str] | None = None) -> None:
    """Write ``folder``'s marker: made by jaxpar as a ``kind`` folder; ``entries`` (None: any) are the
    names jaxpar put in it, the only ones a replacement may delete."""
    body = {
        "kind": kind,
        "entries": None if entries is None else sorted(set(entries) - {MARKER}),
        "note": "written by jaxpar; jaxpar replaces or deletes only folders that hold this file",
    }
    (pathlib.Path(folder) / MARKER).write_text(json.dumps(body, indent=1) + "\n")


def _inside(child: pathlib.Path, parent: pathlib.Path) -> bool:
    return child == parent or parent in child.parents


def check_apart(
    output: PathLike,
    flag: str,
    inputs: dict[str, PathLike | None] | None = None,
    workdirs: dict[str, PathLike | None] | None = None,
) -> None:
    """Refuse an ``output`` that is or contains one of ``inputs`` or ``workdirs`` (name -> path; the
    name, e.g. ``--config`` or ``train.workdir``, is what the error says it is)."""
    out = real(output)
    for what, table in (("input", inputs or {}), ("run's workdir", workdirs or {})):
        for name, path in table.items():
            if not path:
                continue
            other = real(path)
            if _inside(other, out):
                relation = "is" if other == out else "contains"
                raise ConfigError(
                    f"{flag} {output}: {relation} the {what} {name}='{path}', which writing it would "
                    "destroy; pick a folder or file outside it"
                )


Older = Callable[[pathlib.Path, list[str]], bool]  # recognises an unmarked folder an older jaxpar wrote


def foreign(folder: pathlib.Path, kind: str, older: Older | None = None) -> str | None:
    """Why ``folder`` (an existing folder) may not be replaced as a ``kind`` folder, or None when it may:
    it is empty, or jaxpar made it as ``kind`` and it holds nothing jaxpar did not put there, or it has no
    marker but ``older(folder, names)`` recognises it as what a jaxpar from before markers wrote."""
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return None
    marker = read_marker(folder)
    if marker is None and older is not None and older(folder, names):
        return None
    if marker is None:
        return f"holds files jaxpar did not write ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
    if marker["kind"] != kind:
        return f"is a jaxpar {marker['kind']} folder, not a {kind} folder"
    listed = marker.get("entries")
    if listed is not None:
        extra = [n for n in names if n != MARKER and n not in listed]
        if extra:
            return f"holds files jaxpar did not write there ({', '.join(extra[:3])})"
    return None


def check_folder_output(output: PathLike, flag: str, kind: str, overwrite: bool, older: Older | None = None) -> None:
    """Refuse ``output`` as a ``kind`` folder to (re)write: a file; an existing folder without
    ``overwrite`` (unless empty); one that is not jaxpar's own ``kind`` output (``older``: :func:`foreign`)."""
    path = pathlib.Path(output)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ConfigError(f"{flag} {output}: is a file or a link, not a folder; pick a new folder")
    if not path.exists() or not any(path.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"{flag} {output}: exists; pass --overwrite to replace it or choose another folder")
    why = foreign(path, kind, older)
    if why:
        raise ConfigError(
            f"{flag} {output}: {why}; jaxpar replaces only a {kind} folder it wrote: "
            "move those files or pick another folder"
        )


@contextlib.contextmanager
def naming(path: PathLike) -> Iterator[None]:
    """An :class:`OSError` without a file name raised inside (a full disk while writing) gets ``path``
    as its file name, so that the one-line error says where."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror or os.strerror(e.errno), os.fspath(path)) from e
        raise


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(error: BaseException, path: PathLike) -> OSError | None:
    """An OSError naming ``path`` when ``error`` or one of its causes is a full disk (or quota), else None:
    libraries that write in threads (orbax) wrap the OS's error in their own."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return OSError(e.errno, e.strerror or os.strerror(e.errno), os.fspath(path))
        e = e.__cause__ or e.__context__
    return None


def replace_folder(
    output: PathLike,
    kind: str,
    fill: Callable[[pathlib.Path], None],
    *,
    flag: str,
    overwrite: bool = False,
    older: Older | None = None,
) -> pathlib.Path:
    """Write ``output`` as a ``kind`` folder: ``fill(tmp)`` writes the files into a temporary sibling,
    which is marked and renamed into place; a previous output is removed only after (and only if
    :func:`check_folder_output` allows it). A failure leaves the previous output as it was."""
    out = pathlib.Path(output)
    check_folder_output(out, flag, kind, overwrite, older)
    with naming(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would stay on the renamed folder
        with naming(tmp):
            fill(tmp)
            mark(tmp, kind, (p.name for p in tmp.iterdir()))
        old = None
        if out.exists():
            check_folder_output(out, flag, kind, overwrite, older)  # again: it may have changed while filling
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_file_output(
    output: PathLike,
    flag: str,
    overwrite: bool,
    owned: Callable[[str], bool],
    inputs: dict[str, PathLike | None] | None = None,
) -> None:
    """Refuse ``output`` as a file to (re)write: one of ``inputs``; a missing folder; an existing file without
    ``overwrite``, or one whose first 4 KiB ``owned`` does not recognise as jaxpar's."""
    target = pathlib.Path(output)
    check_apart(target, flag, inputs)
    if target.parent and not target.parent.exists():
        raise ConfigError(f"{flag} {output}: folder '{target.parent}' does not exist; create it or pick another path")
    if not os.path.lexists(target):
        return
    if not overwrite:
        raise ConfigError(f"{flag} {output}: the file exists; pass --overwrite to replace it or choose another path")
    if target.is_symlink() or not target.is_file():
        raise ConfigError(f"{flag} {output}: is not a regular file; pick another path")
    head = files.read_head(target, "run record", flag, "pick another path", 4096).decode(errors="replace")
    if not owned(head):
        raise ConfigError(
            f"{flag} {output}: jaxpar did not write this file; --overwrite replaces only a file "
            "jaxpar wrote: move it or pick another path"
        )


def write_file(
    output: PathLike,
    text: str,
    *,
    flag: str,
    overwrite: bool,
    owned: Callable[[str], bool],
    inputs: dict[str, PathLike | None] | None = None,
) -> None:
    """Write ``text`` to the file ``output`` through a temporary sibling and a rename, after
    :func:`check_file_output`. Without ``overwrite`` the final step is a hard link, which never replaces a
    file that appears meanwhile. A failure (a full disk) leaves an earlier file as it was."""
    target = pathlib.Path(output)
    check_file_output(target, flag, overwrite, owned, inputs)
    exists = ConfigError(f"{flag} {output}: the file exists; pass --overwrite to replace it or choose another path")
    with naming(target):
        fd, tmp = tempfile.mkstemp(dir=target.parent or ".", prefix=f".{target.name}.", suffix=".tmp")
    try:
        with naming(target), os.fdopen(fd, "w") as f:
            f.write(text)
        if overwrite:
            os.replace(tmp, target)
            return
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise exists from None
        except OSError:  # a filesystem without hard links: the check above is all there is
            os.replace(tmp, target)
    finally:
        pathlib.Path(tmp).unlink(missing_ok=True)


def remove_owned(folder: PathLike, kind: str) -> None:
    """Delete ``folder`` only if jaxpar made it as ``kind`` (or it is empty); else ConfigError."""
    path = pathlib.Path(folder)
    if not path.exists():
        return
    why = foreign(path, kind) if path.is_dir() and not path.is_symlink() else "is not a folder"
    if why:
        raise ConfigError(f"{folder}: {why}; jaxpar deletes only folders it made: move those files")
    shutil.rmtree(path)
