"""The mapping report every importer returns, and the small helpers the importers share.

A port must never drop a setting silently: each source field ends up as exactly one entry,

* ``mapped``       -- carried over to a jaxpar field with the same meaning,
* ``approximated`` -- carried over in spirit (the note says how it differs), or a no-op in
  jaxpar with the reason it does not matter,
* ``unsupported``  -- jaxpar has no counterpart (the note says why and what comes closest),
* ``unknown``      -- the source tool does not define the key (DeepSpeed silently ignores such
  keys; we report them with the closest known key, so typos surface).

An ``unsupported`` entry may also be a **model change** (``Entry.model``): what jaxpar would train
is not the recipe's model (an unknown family or flavor, MoE as a dense backbone, ALiBi, MLA, a
shape the recipe does not state). :func:`jaxpar.port.recipe.port_recipe` refuses a port with a
model change (exit 2, one line naming it and the fix) unless ``--approximate`` is given; then
the report lists the model changes first and closes with a summary line saying the config does
not train the recipe's model. ``Entry.needs`` names the jaxpar fields that resolve a change when
the user gives them all (``--set model.vocab_size=...``, ``--model-config``). Changes of
precision, speed or memory only stay ``approximated``/``unsupported`` rows without the flag.

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
from jaxpar.optim.fields import OPTIONAL_FIELDS

STATUSES = ("mapped", "approximated", "unsupported", "unknown")
# the fields that fix a model's shape: a port that sets none of them for a field trains jaxpar's
# default (a 4-layer toy) there, so each must come from the recipe, --set or --model-config
SHAPE_FIELDS = (
    "model.num_layers",
    "model.embed_dim",
    "model.num_heads",
    "model.num_kv_heads",
    "model.head_dim",
    "model.mlp_dim",
    "model.vocab_size",
)


@dataclasses.dataclass
class Entry:
    """One source field: where it came from, its value, and what became of it."""

    source: str
    value: Any
    status: str
    target: str = ""
    note: str = ""
    model: bool = False  # a model change: the config would not train the recipe's model
    fix: str = ""  # model changes: what the user can do about it (besides --approximate)
    needs: tuple[str, ...] = ()  # model changes: jaxpar fields that, all given, resolve it

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "value": _jsonable(self.value),
            "status": self.status,
            "target": self.target,
            "note": self.note,
            "model_change": self.model,
        }


@dataclasses.dataclass
class Report:
    """Entries for every source field of one ported recipe."""

    kind: str
    source_path: str = ""
    entries: list[Entry] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    ported: list[str] = dataclasses.field(default_factory=list)  # jaxpar keys the port set explicitly
    unknowns: int = 0  # keys reported unknown so far

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

    def model_change(
        self, source: str, value: Any, note: str, fix: str = "", needs: tuple[str, ...] = (), target: str = ""
    ) -> Entry:
        """A setting jaxpar cannot follow without training another model (see the module docstring):
        ``note`` says what differs, ``fix`` what the user can do (``--approximate`` is added by the
        refusal), ``needs`` the fields that resolve it once all are given."""
        entry = self.add(source, value, "unsupported", target, note)
        entry.model, entry.fix, entry.needs = True, fix, tuple(needs)
        return entry

    @property
    def model_changes(self) -> list[Entry]:
        """The model changes, in order (the config does not train the recipe's model when any is left)."""
        return [e for e in self.entries if e.model]

    def unknown(self, source: str, value: Any, known: list[str] | tuple[str, ...], tool: str) -> Entry:
        """Report a key the source tool does not define, with the closest known key."""
        self.unknowns += 1  # a suggestion costs a scan of ``known``: only the first SUGGESTED get one
        close = suggest(source, known) if self.unknowns <= SUGGESTED else None
        hint = f"did you mean '{close}'? " if close else ""
        return self.add(source, value, "unknown", "", f"{hint}not a {tool} setting ({tool} ignores it); left out")

    def find(self, source: str) -> Entry | None:
        """The first entry for ``source`` (exact match), or None."""
        return next((e for e in self.entries if e.source == source), None)

    def by_status(self, status: str) -> list[Entry]:
        return [e for e in self.entries if e.status == status]

    def ordered(self) -> list[Entry]:
        """The entries as shown: model changes first, then by status (mapped first)."""
        return self.model_changes + [e for s in STATUSES for e in self.by_status(s) if not e.model]

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
            "model_changes": [e.source for e in self.model_changes],
            "entries": [e.to_dict() for e in self.ordered()],
            "closing": self.closing(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> str:
        c = self.counts()
        return ", ".join(f"{c[s]} {s}" for s in STATUSES)

    def closing(self) -> str:
        """The closing summary line: whether the config trains the recipe's model, and what else differs."""
        c = self.counts()
        rest = f"{c['approximated']} approximated, {c['unsupported'] - len(self.model_changes)} unsupported"
        if self.model_changes:
            names = ", ".join(e.source for e in self.model_changes)
            return (
                f"MODEL CHANGED ({len(self.model_changes)}: {names}): this config does NOT train the recipe's "
                f"model (jaxpar port refuses it without --approximate); besides: {rest}"
            )
        return f"model: the recipe's; besides: {rest} (none of them changes the model; see their notes)"

    def render_text(self) -> str:
        """Plain text, one line per entry: model changes first, then grouped by status (mapped first),
        then the problems and the closing summary line."""
        lines = [f"{self.kind} recipe {self.source_path or '(inline)'}: {self.summary()}"]
        for e in self.ordered():
            arrow = f" -> {e.target}" if e.target else ""
            note = f"  ({e.note})" if e.note else ""
            label = "MODEL CHANGE" if e.model else e.status
            lines.append(f"  {label:<12} {e.source} = {_short(e.value)}{arrow}{note}")
        for problem in self.problems:
            lines.append(f"  PROBLEM      {problem}")
        lines.append(f"  {self.closing()}")
        return "\n".join(lines)

    def render_rich(self, console: Any = None) -> None:
        """Print the report as a rich table (to ``console`` or a new stdout console)."""
        from rich.table import Table

        from jaxpar.console import wide_console

        style = {"mapped": "green", "approximated": "yellow", "unsupported": "red", "unknown": "magenta"}
        table = Table(title=f"{self.kind} recipe {self.source_path or '(inline)'}: {self.summary()}")
        for column in ("status", "source field", "value", "jaxpar field", "note"):
            table.add_column(column, overflow="fold")
        for e in self.ordered():
            label = "[bold red]MODEL CHANGE[/]" if e.model else f"[{style[e.status]}]{e.status}[/]"
            table.add_row(label, e.source, _short(e.value), e.target, e.note)
        console = console or wide_console()
        console.print(table)
        for problem in self.problems:
            console.print(f"[red]problem:[/] {problem}")
        console.print(f"[bold red]{self.closing()}[/]" if self.model_changes else self.closing())


def refuse_model_changes(report: Report, source: str, approximate: bool, final: bool = False) -> None:
    """Resolve the model changes whose fields were all given (``--set``, ``--model-config``: in
        ``report.ported``); refuse with one line naming the first one left and its fix (``{needs}`` in a fix:
    the fields still missing), unless ``approximate``.

        ``final``: only the changes no field resolves (an importer refusing early, before it knows the
        fields given on the command line)."""
    stated = set(report.ported)
    for entry in report.model_changes:
        if entry.needs and all(n in stated for n in entry.needs) and not final:
            entry.model, entry.status = False, "mapped"
            entry.note = f"{entry.note}; given on the command line ({', '.join(entry.needs)})"
    pending = [e for e in report.model_changes if not (final and e.needs)]
    if not pending or approximate:
        return
    first = pending[0]
    fix = first.fix
    left = [n for n in first.needs if n not in stated]
    if "{needs}" in fix or (left and not fix):
        fix = (fix or "give {needs} with --set FIELD=VALUE").replace("{needs}", ", ".join(left))
    more = (
        f" (and {len(pending) - 1} more model change(s): {', '.join(e.source for e in pending[1:])})"
        if len(pending) > 1
        else ""
    )
    value = "" if first.value is None else f" = {_short(first.value)}"
    raise ConfigError(
        f"port {source}: {first.source}{value}: {first.note}; jaxpar would not train the recipe's model: "
        f"{fix + ', or ' if fix else ''}pass --approximate to port it anyway (the report then lists the change "
        f"first){more}"
    )


SUGGESTED = 100  # unknown keys of a recipe that get a "did you mean" (a recipe of 100k unknown keys stays linear)


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


# fp16 under torch's GradScaler (torch autocast, accelerate): jaxpar runs DeepSpeed's and Megatron's
# loss-scale rules (train.loss_scale), not GradScaler's, so these port to bfloat16 instead (fp32's range,
# no scale needed): a precision change only, reported as approximated (the policy: precision, speed and
# memory changes port with exit 0). DeepSpeed's fp16 section and Megatron's --fp16 port exactly.
FP16_AS_BF16 = (
    "fp16 with torch's GradScaler -> bf16: jaxpar runs DeepSpeed's and Megatron's loss-scale rules "
    "(train.loss_scale), not GradScaler's, so the port computes in bfloat16 (fp32's range, 3 fewer "
    "mantissa bits than fp16): a precision change only"
)
LOSS_SCALE_NOOP = "no-op in jaxpar: a loss scale serves fp16 only, and this port does not compute in float16"


def build_config(values: dict[str, Any], report: Report) -> ConfigDict:
    """Overlay ported ``values`` (flat ``section.field`` keys) on the defaults; validate.

    A config that does not validate is still returned; the validation message is recorded in
    ``report.problems`` so the caller can show the whole report before failing.
    """
    cfg = merge_into_defaults(values, source=f"port {report.kind}")
    report.ported = sorted(values)
    missing = [f for f in SHAPE_FIELDS if f not in values]
    changes = report.model_changes
    explained = any(not e.needs for e in changes) or set(missing) <= {n for e in changes for n in e.needs}
    if missing and not explained:  # the safety net: no port trains jaxpar's default shape silently
        defaults = flatten(default_config().to_dict())
        report.model_change(
            "(model shape)",
            {f: defaults[f] for f in missing},
            f"the recipe does not state {', '.join(missing)}: jaxpar's defaults (a small test model) would be trained",
            "give them with --set FIELD=VALUE",
            needs=tuple(missing),
            target="model.*",
        )
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
