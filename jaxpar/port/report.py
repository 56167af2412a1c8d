"""The mapping report every importer returns, and the small helpers the importers share.

A port must never drop a setting silently: each source field ends up as exactly one entry,

* ``mapped``       -- carried over to a jaxpar field with the same meaning,
* ``approximated`` -- carried over in spirit (the note says how it differs), or a no-op in
  jaxpar with the reason it does not matter,
* ``unsupported``  -- jaxpar has no counterpart (the note says why and what comes closest),
* ``unknown``      -- the source tool does not define the key (DeepSpeed silently ignores such
  keys; we report them with the closest known key, so typos surface).

Problems found after mapping (the ported config does not validate) are kept apart in
``Report.problems``. The report renders as a rich table, plain text, or JSON.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

from jaxpar.config import (
    SCHEDULE_TYPES,
    ConfigDict,
    ConfigError,
    default_config,
    flatten,
    merge_into_defaults,
    validate,
)
from jaxpar.optim.lr import OPTIONAL_FIELDS

STATUSES = ("mapped", "approximated", "unsupported", "unknown")


@dataclasses.dataclass
class Entry:
    """One source field: where it came from, its value, and what became of it."""

    source: str
    value: Any
    status: str
    target: str = ""
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "value": _jsonable(self.value),
            "status": self.status,
            "target": self.target,
            "note": self.note,
        }


@dataclasses.dataclass
class Report:
    """Entries for every source field of one ported recipe."""

    kind: str
    source_path: str = ""
    entries: list[Entry] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    ported: list[str] = dataclasses.field(default_factory=list)  # jaxpar keys the port set explicitly

    def add(self, source: str, value: Any, status: str, target: str = "", note: str = "") -> Entry:
        if status not in STATUSES:
            raise ValueError(f"report status '{status}' is not one of {STATUSES}")
        entry = Entry(source, value, status, target, note)
        self.entries.append(entry)
        return entry

    def mapped(self, source: str, value: Any, target: str, note: str = "") -> Entry:
        return self.add(source, value, "mapped", target, note)

    def approximated(self, source: str, value: Any, target: str = "", note: str = "") -> Entry:
        return self.add(source, value, "approximated", target, note)

    def unsupported(self, source: str, value: Any, note: str, target: str = "") -> Entry:
        return self.add(source, value, "unsupported", target, note)

    def unknown(self, source: str, value: Any, known: list[str] | tuple[str, ...], tool: str) -> Entry:
        """Report a key the source tool does not define, with the closest known key."""
        close = suggest(source, known)
        hint = f"did you mean '{close}'? " if close else ""
        return self.add(source, value, "unknown", "", f"{hint}not a {tool} setting ({tool} ignores it); left out")

    def find(self, source: str) -> Entry | None:
        """The first entry for ``source`` (exact match), or None."""
        return next((e for e in self.entries if e.source == source), None)

    def by_status(self, status: str) -> list[Entry]:
        return [e for e in self.entries if e.status == status]

    def counts(self) -> dict[str, int]:
        return {s: len(self.by_status(s)) for s in STATUSES}

    @property
    def valid(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "source": self.source_path,
            "counts": self.counts(),
            "problems": list(self.problems),
            "entries": [e.to_dict() for e in self.entries],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> str:
        c = self.counts()
        return ", ".join(f"{c[s]} {s}" for s in STATUSES)

    def render_text(self) -> str:
        """Plain text, one line per entry, grouped by status (mapped first)."""
        lines = [f"{self.kind} recipe {self.source_path or '(inline)'}: {self.summary()}"]
        for status in STATUSES:
            for e in self.by_status(status):
                arrow = f" -> {e.target}" if e.target else ""
                note = f"  ({e.note})" if e.note else ""
                lines.append(f"  {status:<12} {e.source} = {_short(e.value)}{arrow}{note}")
        for problem in self.problems:
            lines.append(f"  PROBLEM      {problem}")
        return "\n".join(lines)

    def render_rich(self, console: Any = None) -> None:
        """Print the report as a rich table (to ``console`` or a new stdout console)."""
        from rich.table import Table

        from jaxpar.console import wide_console

        style = {"mapped": "green", "approximated": "yellow", "unsupported": "red", "unknown": "magenta"}
        table = Table(title=f"{self.kind} recipe {self.source_path or '(inline)'}: {self.summary()}")
        for column in ("status", "source field", "value", "jaxpar field", "note"):
            table.add_column(column, overflow="fold")
        for status in STATUSES:
            for e in self.by_status(status):
                table.add_row(f"[{style[status]}]{status}[/]", e.source, _short(e.value), e.target, e.note)
        console = console or wide_console()
        console.print(table)
        for problem in self.problems:
            console.print(f"[red]problem:[/] {problem}")


def suggest(key: str, known: list[str] | tuple[str, ...]) -> str | None:
    """The closest known key to ``key`` (difflib, cutoff 0.6), or None."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return close[0] if close else None


def _short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(_jsonable(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


# --------------------------------------------------------------------------- shared helpers


def schema_has(key: str) -> bool:
    """Whether ``key`` (``section.field``) exists in this jaxpar version's config schema."""
    return key in flatten(default_config().to_dict())


def schema_type(key: str) -> type | None:
    """The type of the default value of ``key``, or None when the schema lacks it."""
    flat = flatten(default_config().to_dict())
    return type(flat[key]) if key in flat else None


def build_config(values: dict[str, Any], report: Report) -> ConfigDict:
    """Overlay ported ``values`` (flat ``section.field`` keys) on the defaults; validate.

    A config that does not validate is still returned; the validation message is recorded in
    ``report.problems`` so the caller can show the whole report before failing.
    """
    cfg = merge_into_defaults(values, source=f"port {report.kind}")
    report.ported = sorted(values)
    try:
        validate(cfg)
    except ConfigError as e:
        report.problems.append(str(e))
    return cfg


def parse_side_value(raw: str) -> Any:
    """A ``--set``/``--var`` value as JSON when it parses (3e-4, true, [0.9, 0.95]), else a string."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return raw


def apply_schedule_fields(fields: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """Copy exact schedule ``fields`` (optim field -> value) into ``values``.

    Returns one note per thing this jaxpar's schema cannot express exactly (an optional field it
    lacks, a fractional step count on an int field, a decay shape it does not validate); an
    empty list means the curve is reproduced exactly.
    """
    notes: list[str] = []
    warmup = fields.get("warmup_steps", 0)
    for key, value in fields.items():
        full = f"optim.{key}"
        kind = schema_type(full)
        if kind is None:
            default = OPTIONAL_FIELDS.get(key)
            if key == "decay_start_step" and value not in (default, warmup):
                notes.append(
                    f"needs {full}={value:g} (not in this jaxpar's config schema): the decay starts at "
                    f"step {warmup:g} instead"
                )
            elif key == "schedule_offset" and value != default:
                notes.append(
                    f"needs {full}={value} (not in this jaxpar's config schema): jaxpar's update k uses "
                    f"the lr the source uses at update k+{value}"
                )
            continue
        if kind is int and isinstance(value, float):
            rounded = int(round(value))
            if rounded != value:
                notes.append(f"{full}={value:g} rounded to {rounded} (this jaxpar's schema counts whole steps)")
            value = rounded
        if key == "schedule" and value not in SCHEDULE_TYPES:
            notes.append(f"decay shape '{value}' is not in this jaxpar's optim.schedule choices; linear used")
            value = "linear"
        values[full] = value
    return notes
