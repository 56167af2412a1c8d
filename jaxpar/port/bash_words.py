"""Expansion for the bash subset of launch scripts: variables and arrays, ``$VAR`` / ``${VAR:-x}`` /
``$((a*b))``, quoting and word splitting, with unknown values kept as in-band markers."""

from __future__ import annotations

import ast
import re

_OPEN, _CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_OPEN}([^{_CLOSE}]*){_CLOSE}")
ASSIGN = re.compile(r"^(?:export\s+|declare\s+(?:-\w+\s+)*|local\s+|readonly\s+)?([A-Za-z_]\w*)=(.*)$", re.S)
_ARITH_OK = re.compile(r"^[\d\s+\-*/%()<>]*$")


class UnbalancedQuote(ValueError):
    """A quote opened on a line is never closed there."""


def mark(name: str) -> str:
    """The in-band marker for an unresolved variable ``name`` inside expanded text (no spaces)."""
    return f"{_OPEN}{_label(name)}{_CLOSE}"


def _label(text: str) -> str:
    return re.sub(r"\s+", "", text)


def unresolved_names(text: str) -> list[str]:
    """Names of unresolved variables marked in ``text``, in order, without repeats."""
    return list(dict.fromkeys(_MARK.findall(text)))


def show(text: str) -> str:
    """``text`` with unresolved markers written back as ``$NAME``."""
    return _MARK.sub(lambda m: f"${m.group(1)}", text)


class Shell:
    """Variables and expansion for the bash subset found in launch scripts.

    Unknown values never become empty strings (as bash would make them): they stay marked, so
    the importer can name exactly which variable a setting needs. ``why`` says, per variable,
    what it is missing (``"not set"``, ``"needs SLURM_NNODES"``, ``"command substitution"``).
    User-given variables win over the script's own assignments.
    """

    def __init__(self, variables: dict[str, str] | None = None) -> None:
        self.user = {k: str(v) for k, v in (variables or {}).items()}
        self.env: dict[str, str] = dict(self.user)
        self.env["#"] = str(next(k for k in range(len(self.user) + 1) if str(k + 1) not in self.user))  # $#
        self.why: dict[str, str] = {}
        self.read: set[str] = set()  # variables whose value an expansion asked for (unused --var is refused)
        # variables an unknown `if` condition decides: name -> (what is unknown, variable to pass)
        self.conditions: dict[str, tuple[str, str | None]] = {}
        self.exists: dict[str, str] = {}  # paths the script made: "d" (mkdir) or "f" (touch)
        self.allow_unresolved = False  # skip assignments under unknown conditions instead of refusing
        self.skipped: list[str] = []  # unknown conditions whose branches were skipped (allow_unresolved)
        self.script: str | None = None  # the pretrain_*.py the launch command runs (its file name)
        self.cleared: set[str] = set()  # variables the script unset (known empty)

    def assign(self, name: str, raw: str, words: bool = False) -> None:
        """``NAME=raw`` as bash would do it (quote removal, expansion, no word splitting).

        ``words=True`` assigns an array's elements (``NAME=( ... )``), kept as one
        space-separated string that ``${NAME[@]}`` splits again.
        """
        if name in self.user:
            return
        self.cleared.discard(name)
        raw = raw.strip()
        placeholder = re.match(r"<[^<>]*>", raw)  # `<Specify path>`, `<Specify path>/vocab.json`
        if placeholder:
            self._unknown(name, "placeholder " + placeholder.group(0))
            return
        try:
            parts = self.words(raw) if words else self.words(raw, split_expansions=False)[:1]
        except UnbalancedQuote:
            self._unknown(name, "its multi-line value was cut off")
            return
        value = " ".join(parts)
        decided = next((n for n in unresolved_names(value) if n in self.conditions), None)
        if decided is not None:
            self._unknown(name, self.why.get(decided, "set under an unknown condition"))
            self.conditions[name] = self.conditions[decided]
            return
        inner = [n for n in unresolved_names(value) if n != name]
        if (inner or unresolved_names(value)) and not (words or re.search(r"\s", value)) or name in inner:
            self._unknown(name, "needs " + ", ".join(f"${n}" if n.isdigit() else n for n in inner or [name]))
        else:  # known, or a string of several words that keeps its unknown ones marked (flags read them)
            self.env[name] = value
        self.conditions.pop(name, None)

    def append(self, name: str, raw: str) -> None:
        """``NAME+=( raw )`` onto the known array ``name``."""
        before = self.env[name]
        self.assign(name, raw, words=True)
        if self.env.get(name) != mark(name):  # else the new elements made it unknown (``why`` says how)
            self.env[name] = " ".join(part for part in (before, self.env[name]) if part)

    def taint(self, name: str, unknown: tuple[str, str | None]) -> None:
        """``name`` is assigned in a branch of an unknown condition: it becomes unknown, tagged with it."""
        if name in self.user:
            return
        if self.allow_unresolved:
            if unknown[0] not in self.skipped:
                self.skipped.append(unknown[0])
            return
        self._unknown(name, unknown[0])
        self.conditions[name] = unknown

    def _unknown(self, name: str, why: str) -> None:
        self.env[name] = mark(name)
        self.why[name] = why

    def words(self, text: str, split: bool = True, split_expansions: bool = True) -> list[str]:
        """Expand ``text`` into words (one string when ``split`` is False).

        ``split_expansions=False`` keeps each expansion inside its word, as in assignments.
        """
        out: list[str] = []
        cur: list[str] = []
        started = False
        i, n = 0, len(text)

        def flush() -> None:
            nonlocal cur, started
            if started:
                out.append("".join(cur))
            cur, started = [], False

        while i < n:
            c = text[i]
            if c.isspace() and split:
                flush()
                i += 1
            elif c == "#" and split and not started:
                break
            elif c == "'":
                j = text.find("'", i + 1)
                if j < 0:
                    raise UnbalancedQuote(text)
                cur.append(text[i + 1 : j])
                started, i = True, j + 1
            elif c == '"':
                piece, i = self._dquote(text, i + 1)
                cur.append(piece)
                started = True
            elif c == "\\" and i + 1 < n:
                cur.append(text[i + 1])
                started, i = True, i + 2
            elif c in "$`":
                piece, i = self._dollar(text, i)
                if not (split and split_expansions):
                    cur.append(piece)
                    started = True
                    continue
                parts = piece.split()
                if piece[:1].isspace():
                    flush()
                for k, part in enumerate(parts):
                    if k:
                        flush()
                    cur.append(part)
                    started = True
                if piece[-1:].isspace():
                    flush()
            else:
                cur.append(c)
                started, i = True, i + 1
        flush()
        return out if split else ["".join(out)]

    def string(self, text: str) -> str:
        return self.words(text, split=False)[0]

    def _dquote(self, text: str, i: int) -> tuple[str, int]:
        out: list[str] = []
        while i < len(text):
            c = text[i]
            if c == '"':
                return "".join(out), i + 1
            if c == "\\" and i + 1 < len(text) and text[i + 1] in '"\\$`':
                out.append(text[i + 1])
                i += 2
            elif c in "$`":
                piece, i = self._dollar(text, i)
                out.append(piece)
            else:
                out.append(c)
                i += 1
        raise UnbalancedQuote(text)

    def _dollar(self, text: str, i: int) -> tuple[str, int]:
        if text[i] == "`":
            j = text.find("`", i + 1)
            if j < 0:
                raise UnbalancedQuote(text)
            return self._command(text[i + 1 : j]), j + 1
        nxt = text[i + 1 : i + 2]
        if text.startswith("$((", i):
            close = _match(text, i + 1, "(", ")")
            return self._arith(text[i + 3 : close - 1]), close + 1
        if nxt == "(":
            close = _match(text, i + 1, "(", ")")
            return self._command(text[i + 2 : close]), close + 1
        if nxt == "{":
            close = _match(text, i + 1, "{", "}")
            return self._param(text[i + 2 : close]), close + 1
        m = re.match(r"[A-Za-z_]\w*|\d|[@*#?$!-]", text[i + 1 :])
        if not m:
            return "$", i + 1
        return self.var(m.group(0)), i + 1 + len(m.group(0))

    def var(self, name: str) -> str:
        """The value of ``name``, or its marker when it is not known."""
        self.read.add(name)
        if name in self.env:
            return self.env[name]
        if name in self.cleared:  # `unset NAME`: empty, as bash expands it
            return ""
        self.why.setdefault(name, f"the script's argument ${name}, not given" if name.isdigit() else "not set")
        return mark(name)

    def _command(self, cmd: str) -> str:
        label = _label("$(" + cmd.strip().split(" ")[0] + "...)")
        self.why[label] = "command substitution"
        return mark(label)

    def _param(self, inner: str) -> str:
        m = re.match(r"(#?)([A-Za-z_]\w*|\d+|[@*])(\[[@*]\])?(:?[-=+?])?(.*)$", inner, re.S)
        if not m or (m.group(5) and not m.group(4)):
            label = _label("${" + inner + "}")
            self.why[label] = "unsupported expansion"
            return mark(label)
        length, name, _, op, word = m.groups()
        self.read.add(name)
        value = self.env.get(name)
        if op:
            empty = value is None or (op.startswith(":") and value == "")
            if op.endswith("+"):
                return "" if empty else self.string(word)
            if empty:
                value = self.string(word)
                if op.endswith("="):
                    self.env[name] = value
                return value
        text = value if value is not None else self.var(name)
        return str(len(text)) if length and value is not None else text

    def _arith(self, expr: str) -> str:
        expanded = self.string(expr)
        if unresolved_names(expanded):
            return "".join(mark(n) for n in unresolved_names(expanded))
        expanded = re.sub(r"[A-Za-z_]\w*", lambda m: self.var(m.group(0)), expanded)
        if unresolved_names(expanded) or not _ARITH_OK.match(expanded):
            return "".join(mark(n) for n in unresolved_names(expanded)) or mark("$((" + expr + "))")
        try:
            return str(evaluate(ast.parse(expanded.strip(), mode="eval").body))
        except (SyntaxError, ZeroDivisionError, ValueError):
            return mark("$((" + expr + "))")


_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Div: lambda a, b: int(a / b),
    ast.Mod: lambda a, b: a % b,
    ast.LShift: lambda a, b: a << b,
    ast.RShift: lambda a, b: a >> b,
}


def evaluate(node: ast.AST) -> int:
    """Integer arithmetic as bash's $(( )) does it: + - * / % << >>, comparisons and parentheses."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        return int(_COMPARE[type(node.ops[0])](evaluate(node.left), evaluate(node.comparators[0])))
    if isinstance(node, ast.BoolOp):
        values = [evaluate(v) != 0 for v in node.values]
        return int(all(values) if isinstance(node.op, ast.And) else any(values))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return int(evaluate(node.operand) == 0)
    raise ValueError("not integer arithmetic")


_COMPARE = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
}


def _match(text: str, start: int, open_: str, close: str) -> int:
    """Index of the bracket closing the one at ``start``."""
    depth = 0
    for k in range(start, len(text)):
        if text[k] == open_:
            depth += 1
        elif text[k] == close:
            depth -= 1
            if depth == 0:
                return k
    raise UnbalancedQuote(text)
