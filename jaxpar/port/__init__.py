"""Importers for PyTorch training recipes (DeepSpeed, Megatron-LM, torchtitan, FSDP/accelerate).

Each ``port_*`` function returns ``(ConfigDict, Report)``; the report says what became of every
source setting. This module also holds the small bash-subset reader that turns launch-script
text (variable assignments, ``$VAR`` / ``${VAR:-default}`` / ``$((a*b))`` expansion, quoting
and word splitting) into words and flags (:func:`launch_flags`), so importers never ``eval``
user scripts.
"""

from __future__ import annotations

import ast
import re

_OPEN, _CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_OPEN}([^{_CLOSE}]*){_CLOSE}")
_ASSIGN = re.compile(r"^(?:export\s+|declare\s+(?:-\w+\s+)*|local\s+|readonly\s+)?([A-Za-z_]\w*)=(.*)$", re.S)
_ARITH_OK = re.compile(r"^[\d\s+\-*/%()]*$")


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
        self.why: dict[str, str] = {}
        self.read: set[str] = set()  # variables whose value an expansion asked for (unused --var is refused)

    def assign(self, name: str, raw: str, words: bool = False) -> None:
        """``NAME=raw`` as bash would do it (quote removal, expansion, no word splitting).

        ``words=True`` assigns an array's elements (``NAME=( ... )``), kept as one
        space-separated string that ``${NAME[@]}`` splits again.
        """
        if name in self.user:
            return
        raw = raw.strip()
        if raw.startswith("<") and raw.endswith(">"):
            self._unknown(name, "placeholder " + raw)
            return
        try:
            parts = self.words(raw) if words else self.words(raw, split_expansions=False)[:1]
        except UnbalancedQuote:
            self._unknown(name, "its multi-line value was cut off")
            return
        value = " ".join(parts)
        inner = [n for n in unresolved_names(value) if n != name]
        if inner or unresolved_names(value):
            self._unknown(name, "needs " + ", ".join(inner or [name]))
        else:
            self.env[name] = value

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
        self.why.setdefault(name, "script argument, not given" if name.isdigit() else "not set")
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
            return str(_evaluate(ast.parse(expanded.strip(), mode="eval").body))
        except (SyntaxError, ZeroDivisionError, ValueError):
            return mark("$((" + expr + "))")


_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Div: lambda a, b: int(a / b),
    ast.Mod: lambda a, b: a % b,
}


def _evaluate(node: ast.AST) -> int:
    """Integer arithmetic as bash's $(( )) does it: + - * / % and parentheses, nothing else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("not integer arithmetic")


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


def split_assignment(line: str) -> tuple[str, str] | None:
    """``(name, raw value)`` when ``line`` is a shell variable assignment, else None."""
    m = _ASSIGN.match(line.strip())
    return (m.group(1), m.group(2)) if m else None


def launch_flags(text: str, shell: Shell) -> tuple[list[tuple[str, list[str]]], list[str], list[tuple[int, str]]]:
    """Run the assignments in ``text`` and return ``(flags, stray words, repaired lines)``.

    ``text`` is either the ``.args`` format (assignments, a ``# flags`` line, one flag per line)
    or a launch script: the flags are the words after ``pretrain_*.py`` on the first command
    that runs it (after expansion, so ``$CMD`` indirection works), plus the launcher's own
    ``--nproc_per_node``-style flags before it. Flags are ``(name, values)``; ``--a=b`` splits.
    Lines with an unbalanced quote are read without their quotes and listed as repaired.
    """
    args_format = any(line.strip() == "# flags" for line in text.splitlines())
    lines = text.splitlines() if args_format else text.replace("\\\n", " ").splitlines()
    words: list[str] = []
    repaired: list[tuple[int, str]] = []
    in_flags = False
    array: list[str] | None = None  # lines of a NAME=( ... ) array being read
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if array is not None:
            array.append(stripped)
            joined = " ".join(array)
            if joined.count("(") <= joined.count(")"):
                name, _, value = joined.partition("=")
                shell.assign(name, value.strip()[1:-1], words=True)
                array = None
            continue
        if stripped == "# flags":
            in_flags = True
            continue
        if not stripped or stripped.startswith("#"):
            continue
        assignment = None if in_flags else split_assignment(stripped)
        if assignment and assignment[1].startswith("(") and not args_format:
            array = [stripped]
            if stripped.count("(") <= stripped.count(")"):
                shell.assign(assignment[0], assignment[1].strip()[1:-1], words=True)
                array = None
            continue
        if assignment:
            shell.assign(*assignment)
            continue
        if args_format and not in_flags:
            continue
        try:
            line_words = shell.words(stripped)
        except UnbalancedQuote:
            line_words = shell.words(stripped.replace('"', "").replace("'", ""))
            repaired.append((number, stripped))
        if in_flags:
            words += line_words
            continue
        script = next(
            (k for k, w in enumerate(line_words) if w.rsplit("/", 1)[-1].startswith("pretrain_") and w.endswith(".py")),
            None,
        )
        if script is not None:
            first = next((k for k, w in enumerate(line_words[:script]) if w.startswith("--")), script)
            words = line_words[first:script] + line_words[script + 1 :]
            break
    flags: list[tuple[str, list[str]]] = []
    stray: list[str] = []
    for word in words:
        if word.startswith("--") and len(word) > 2:
            name, eq, value = word.partition("=")
            flags.append((name, [value] if eq else []))
        elif flags:
            flags[-1][1].append(word)
        else:
            stray.append(word)
    return flags, stray, repaired
