"""The small bash-subset reader behind the Megatron importer: it turns launch-script text into
words and flags (:func:`launch_flags`) without running it: logical lines as bash forms them
(:func:`script_lines`), variable and array assignments and ``+=``, ``$VAR`` / ``${VAR:-default}`` /
``$((a*b))`` expansion, quoting and word splitting, ``if``/``elif``/``else``/``fi``, ``case``,
``while``/``until``/``for`` (never run: one whose condition is known false is skipped, any other
makes what it assigns unknown),
functions (read where called), ``eval`` and ``sh``/``bash -c`` strings, lists, pipes and
redirections around the command. A multi-word value keeps its unknown words marked (the importer
names the flag that needs one); a one-word value with an unknown part is unknown as a whole.

``if`` conditions are evaluated as bash would when every value they read is known: ``[ ]``,
``[[ ]]`` and ``test`` (string ``= == !=``, ``-z``/``-n``, integer ``-eq -ne -lt -le -gt -ge``,
``!``, ``-a``/``-o`` and ``&&``/``||`` inside ``[[ ]]``, parentheses), ``&&``/``||``/``!``
between commands, ``true``/``false``/``:`` and ``(( ))`` with known integers. Only the taken
branch runs. File tests (``-f -d -e`` ...) are known only for paths the script made with
``mkdir``/``touch``; the file system is never read. A condition that reads an unknown value,
tests an unknown file, or is another command is *unknown*: its branches are not run, and every
variable they assign becomes unknown, tagged with the condition. The pretrain command reading
such a variable, or sitting in such a branch, is refused with one line naming the condition's
line and what it reads (:class:`~jaxpar.errors.ConfigError`); with
``Shell.allow_unresolved`` those assignments are skipped instead (both branches skipped, never
both applied) and listed in ``Shell.skipped``. The rule for guard lines such as
``if [ ! -f "$SCRIPT" ]; then echo ...; exit 1; fi``: an ``exit`` inside an unknown branch is
treated as not taken, so it does not stop a port; an ``exit`` in a branch known to be taken
refuses the port (the script would stop there).
"""

from __future__ import annotations

import ast
import fnmatch
import re

from jaxpar.errors import ConfigError

_OPEN, _CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_OPEN}([^{_CLOSE}]*){_CLOSE}")
_ASSIGN = re.compile(r"^(?:export\s+|declare\s+(?:-\w+\s+)*|local\s+|readonly\s+)?([A-Za-z_]\w*)=(.*)$", re.S)
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
            return str(_evaluate(ast.parse(expanded.strip(), mode="eval").body))
        except (SyntaxError, ZeroDivisionError, ValueError):
            return mark("$((" + expr + "))")


_Unknown = tuple  # (what is unknown, the variable to pass with --var or None): a condition's third value
_STRING_OPS = ("=", "==", "!=", "<", ">")
_INT_OPS = {
    "-eq": lambda a, b: a == b,
    "-ne": lambda a, b: a != b,
    "-lt": lambda a, b: a < b,
    "-le": lambda a, b: a <= b,
    "-gt": lambda a, b: a > b,
    "-ge": lambda a, b: a >= b,
}
_FILE_OPS = ("-f", "-d", "-e", "-a", "-r", "-w", "-x", "-s", "-L", "-h", "-p", "-S", "-b", "-c")
_NAME = re.compile(r"[A-Za-z_]\w*|\d+")


class _Condition:
    """One ``if``/``elif`` condition of line ``number``: True, False or an unknown (``_Unknown``)."""

    def __init__(self, shell: Shell, text: str, number: int) -> None:
        self.shell, self.text, self.number = shell, text, number

    def value(self) -> bool | _Unknown:
        try:
            pieces = _split_top(self.text, ("&&", "||"))
        except UnbalancedQuote:
            return self.form()
        result = self.command(pieces[0])
        for op, piece in zip(pieces[1::2], pieces[2::2], strict=True):
            result = _and(result, self.command(piece)) if op == "&&" else _or(result, self.command(piece))
        return result

    def form(self) -> _Unknown:
        return (
            f"line {self.number}: the condition `{self.text}` is not a form jaxpar evaluates "
            "([ ], [[ ]], test, (( )), true, false)",
            None,
        )

    def reads(self, word: str) -> _Unknown:
        name = unresolved_names(word)[0]
        why = self.shell.why.get(name, "not set")
        var = name if _NAME.fullmatch(name) else None
        return (f"line {self.number}: the condition `{self.text}` reads ${name}, which is unknown ({why})", var)

    def command(self, piece: str) -> bool | _Unknown:
        piece = piece.strip()
        if piece.startswith("!") and piece[1:2].isspace():
            return _not(self.command(piece[1:]))
        if piece in ("true", ":"):
            return True
        if piece == "false":
            return False
        try:
            if piece.startswith("((") and piece.endswith("))"):
                return self.arith(piece[2:-2])
            if piece.startswith("[[") and piece.endswith("]]") and piece[2:3].isspace():
                return self.test(self.shell.words(piece[2:-2], split_expansions=False), "&&", "||")
            if piece.startswith("[") and piece.endswith("]") and piece[1:2].isspace():
                return self.test(self.shell.words(piece[1:-1]), "-a", "-o")
            if piece.startswith("test") and piece[4:5].isspace():
                return self.test(self.shell.words(piece[4:]), "-a", "-o")
        except UnbalancedQuote:
            pass
        return self.form()

    def arith(self, expr: str) -> bool | _Unknown:
        expanded = self.shell.string(expr)
        expanded = re.sub(r"[A-Za-z_]\w*", lambda m: self.shell.var(m.group(0)), expanded)
        if unresolved_names(expanded):
            return self.reads(expanded)
        py = expanded.replace("&&", " and ").replace("||", " or ")
        py = re.sub(r"!(?!=)", " not ", py)
        if not re.fullmatch(r"[\d\s+\-*/%()<>=!a-z]*", py):
            return self.form()
        try:
            return _evaluate(ast.parse(py.strip(), mode="eval").body) != 0
        except (SyntaxError, ZeroDivisionError, ValueError):
            return self.form()

    def test(self, words: list[str], and_: str, or_: str) -> bool | _Unknown:
        """``test`` / ``[[ ]]`` expression over expanded ``words`` (three-valued, so an unknown
        side that cannot change the result does not make the whole unknown)."""
        double = and_ == "&&"
        pos = 0

        def peek(k: int = 0) -> str | None:
            return words[pos + k] if pos + k < len(words) else None

        def disjunction() -> bool | _Unknown:
            nonlocal pos
            value = conjunction()
            while peek() == or_:
                pos += 1
                value = _or(value, conjunction())
            return value

        def conjunction() -> bool | _Unknown:
            nonlocal pos
            value = negation()
            while peek() == and_:
                pos += 1
                value = _and(value, negation())
            return value

        def negation() -> bool | _Unknown:
            nonlocal pos
            if peek() == "!" and peek(1) is not None:
                pos += 1
                return _not(negation())
            if peek() == "(":
                pos += 1
                value = disjunction()
                if peek() != ")":
                    raise ValueError
                pos += 1
                return value
            return primary()

        def primary() -> bool | _Unknown:
            nonlocal pos
            word = peek()
            if word is None:
                raise ValueError
            op, right = peek(1), peek(2)
            if op is not None and right is not None and (op in _STRING_OPS or op in _INT_OPS):
                pos += 3
                for side in (word, right):
                    if unresolved_names(side):
                        return self.reads(side)
                return compare(word, op, right)
            if word in ("-z", "-n") and op is not None and op not in (and_, or_, ")"):
                pos += 2
                if unresolved_names(op):
                    return self.reads(op)
                return (op == "") == (word == "-z")
            if word in _FILE_OPS and op is not None and op not in (and_, or_, ")"):
                pos += 2
                if unresolved_names(op):
                    return self.reads(op)
                kind = self.shell.exists.get(op.rstrip("/") or "/")
                if kind and (word in ("-e", "-a") or (word == "-d") == (kind == "d") and word in ("-d", "-f")):
                    return True
                return (
                    f"line {self.number}: the condition `{self.text}` tests the file system ({word} {op}), "
                    "which a port does not read",
                    None,
                )
            if word.startswith("-") and len(word) == 2 and op is not None and op not in (and_, or_, ")"):
                raise ValueError  # another unary test (-v, -t, ...): not evaluated
            pos += 1
            if unresolved_names(word):
                return self.reads(word)
            return word != ""

        def compare(left: str, op: str, right: str) -> bool | _Unknown:
            if op in _INT_OPS:
                try:
                    return _INT_OPS[op](int(left.strip()), int(right.strip()))
                except ValueError:
                    return self.form()
            if op in ("<", ">"):
                return left < right if op == "<" else left > right
            same = fnmatch.fnmatchcase(left, right) if double else left == right
            return same if op in ("=", "==") else not same

        try:
            value = disjunction()
            if pos != len(words):
                raise ValueError
        except ValueError:
            return self.form()
        return value


def _not(v: bool | _Unknown) -> bool | _Unknown:
    return (not v) if isinstance(v, bool) else v


def _and(a: bool | _Unknown, b: bool | _Unknown) -> bool | _Unknown:
    if a is False or b is False:
        return False
    return a if not isinstance(a, bool) else b


def _or(a: bool | _Unknown, b: bool | _Unknown) -> bool | _Unknown:
    if a is True or b is True:
        return True
    return a if not isinstance(a, bool) else b


def _split_top(text: str, seps: tuple[str, ...]) -> list[str]:
    """``text`` split at ``seps`` outside quotes, ``$( )``/``${ }``/``(( ))`` and ``[[ ]]``:
    ``[piece, sep, piece, ...]``."""
    out: list[str] = []
    start = i = depth = 0
    double = False
    special = re.compile("[" + re.escape("\\'\"(){}[]" + "".join({s[0] for s in seps})) + "]")
    while i < len(text):
        found = special.search(text, i)  # the next character that matters (a loop per character is slow)
        if found is None:
            break
        i = found.start()
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "'":
            j = text.find("'", i + 1)
            if j < 0:
                raise UnbalancedQuote(text)
            i = j + 1
            continue
        if c == '"':
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= len(text):
                raise UnbalancedQuote(text)
            i = j + 1
            continue
        if c in "({":
            depth += 1
        elif c in ")}":
            depth = max(depth - 1, 0)  # a case pattern's `)` closes nothing
        elif text.startswith("[[", i) and (i == 0 or text[i - 1].isspace() or text[i - 1] in ";!"):
            double = True
        elif text.startswith("]]", i):
            double = False
        elif depth == 0 and not double:
            sep = next((s for s in seps if text.startswith(s, i)), None)
            if sep is not None and not (sep == ";" and text.startswith(";;", i)):
                out += [text[start:i], sep]
                i = start = i + len(sep)
                continue
        i += 1
    return [*out, text[start:]]


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


def _evaluate(node: ast.AST) -> int:
    """Integer arithmetic as bash's $(( )) does it: + - * / % << >>, comparisons and parentheses."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        return int(_COMPARE[type(node.ops[0])](_evaluate(node.left), _evaluate(node.comparators[0])))
    if isinstance(node, ast.BoolOp):
        values = [_evaluate(v) != 0 for v in node.values]
        return int(all(values) if isinstance(node.op, ast.And) else any(values))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return int(_evaluate(node.operand) == 0)
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


def split_assignment(line: str) -> tuple[str, str] | None:
    """``(name, raw value)`` when ``line`` is a shell variable assignment, else None."""
    m = _ASSIGN.match(line.strip())
    return (m.group(1), m.group(2)) if m else None


_KEYWORDS = ("if", "then", "elif", "else", "fi", "while", "until", "for", "do", "done", "case", "esac", ";;")
_CLAUSE = re.compile(r"^\(?\s*([^()]*?)\s*\)\s*(.*)$", re.S)  # a case clause: `pattern|pattern) commands`
_APPEND = re.compile(r"^([A-Za-z_]\w*)\+=(.*)$", re.S)


class _Frame:
    """One open ``if`` block: the mode of its current branch (``run``, ``skip``, ``taint``)."""

    def __init__(self, mode: str, unknown: _Unknown | None, fixed: bool, kind: str = "if") -> None:
        self.mode, self.unknown, self.fixed, self.kind = mode, unknown, fixed, kind
        self.word: str | _Unknown = ""  # a case's word (expanded), or why it is unknown
        self.pattern = kind == "case"  # a case expects a `pattern)` next
        self.done = mode == "run"  # a branch was taken: later ones are skipped
        self.open_unknown = unknown if mode == "taint" else None  # an earlier condition was unknown


def _statements(line: str) -> list[str]:
    """``line`` as statements when it holds a keyword of :data:`_KEYWORDS` (split at ``;``, ``;;`` kept
    as a statement, and after ``then``/``else``/``do``), else the line itself (kept whole, as before)."""
    try:
        pieces = _split_top(line, (";;", ";"))
    except UnbalancedQuote:
        return [line]
    parts = [p.strip() for k, p in enumerate(pieces) for p in ([p] if k % 2 == 0 else [";;"] if p == ";;" else [])]
    if not any(p.split(None, 1)[:1] and p.split(None, 1)[0] in _KEYWORDS for p in parts):
        return [line]
    out: list[str] = []
    for part in parts:
        while part:
            head, _, rest = part.partition(" ")
            if head in ("then", "else", "do"):
                out.append(head)
                part = rest.strip()
                continue
            inline = re.match(r"(case\s.+?\sin)\s+(\S.*)$", part, re.S) if head == "case" else None
            if inline:  # `case $X in a) ...`: the first clause on the case's line
                out.append(inline.group(1))
                part = inline.group(2)
                continue
            out.append(part)
            break
    return [p for p in out if p]


def _lines(text: str, join: bool) -> list[tuple[int, str]]:
    """``(line number, line)`` with backslash-newline continuations joined (``join``), numbered
    by the line each starts on."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []  # the parts of a continued line so far (joined once: linear in its length)
    start = 0
    for number, line in enumerate(text.split("\n"), 1):
        if pending:
            number = start
        if join and line.endswith("\\"):
            start = number
            pending.append(line[:-1])
            continue
        if pending:
            line = " ".join([*pending, line])
            pending = []
        out.extend((number, part) for part in line.splitlines() or [""])
    if pending:
        out.append((start, " ".join(pending)))
    return out


_SPECIAL = {
    "": re.compile(r"[\n'\"\\`#$<(]"),  # the top level of a line
    '"': re.compile(r'["\\`$]'),
    "(": re.compile(r"[()'\"\\`$#]"),
    "{": re.compile(r"[}'\"\\`$]"),
    "`": re.compile(r"[`\\]"),
}
_HEREDOC = re.compile(r"<<(-?)[ \t]*(['\"]?)([\w.-]+)\2")


def script_lines(text: str) -> list[tuple[int, str]]:
    """``text`` as bash reads it into logical lines: ``(line it starts on, text)``.

    A quoted string, ``$( )``, ``${ }`` or backticks may span lines (their newlines are kept in
    the text); backslash-newline outside single quotes joins lines (both removed, as bash does);
    a ``#`` that starts a word begins a comment to the end of its line (a ``\\`` ending a comment
    continues nothing); here-document bodies (``<<EOF`` ... ``EOF``) are dropped. A quote never
    closed before the end of the file is bash's syntax error: from that line on the text is read
    line by line (the reader then repairs the line). Linear in the text.
    """
    text = text.replace("\r\n", "\n")
    out: list[tuple[int, str]] = []
    i, n, number = 0, len(text), 1
    script_end: tuple[str, bool] | None = None  # the delimiter of a here-document read as a script
    while i < n:
        line, end, body = _logical_line(text, i)
        if end < 0:  # unbalanced (bash: unexpected end of file): the rest line by line, as written
            return out + [(number + k - 1, part) for k, part in _lines(text[i:], join=True)]
        if script_end and (line.lstrip("\t") if script_end[1] else line) == script_end[0]:
            script_end = None
        else:
            out.append((number, line))
        script_end = body or script_end
        number += text.count("\n", i, end)
        i = end
    return out


def _logical_line(text: str, i: int) -> tuple[str, int, tuple[str, bool] | None]:
    """The logical line from ``i``: its text, where the next starts (-1: a quote never closes), and
    the delimiter of a here-document that a shell or ``sbatch`` reads as a script (its body is then
    not skipped: the lines that follow are that script)."""
    n = len(text)
    buf: list[str] = []
    stack: list[list] = []  # open contexts: [kind, depth]
    heredocs: list[tuple[str, bool]] = []
    seg = i
    while True:
        kind = stack[-1][0] if stack else ""
        m = _SPECIAL[kind].search(text, i)
        if m is None:
            if stack:
                return "", -1, None
            buf.append(text[seg:])
            return "".join(buf), n, None
        pos, c = m.start(), m.group(0)
        i = pos + 1
        if c == "\n":  # the end of the logical line (top level only)
            buf.append(text[seg:pos])
            line = "".join(buf)
            if len(heredocs) == 1 and line.split()[0].rsplit("/", 1)[-1] in ("sbatch", "bash", "sh"):
                return line, i, heredocs[0]
            for word, dash in heredocs:  # skip each body up to its delimiter line
                while i < n:
                    nl = text.find("\n", i)
                    body = text[i : n if nl < 0 else nl]
                    i = n if nl < 0 else nl + 1
                    if (body.lstrip("\t") if dash else body) == word:
                        break
            return line, i, None
        if c == "\\":
            if text.startswith("\n", i) and kind != "`":
                buf.append(text[seg:pos])
                seg = i = pos + 2
            else:
                i = pos + 2
        elif c == "'" and kind != '"':
            j = text.find("'", i)
            if j < 0:
                return "", -1, None
            i = j + 1
        elif c == "#":
            if pos == 0 or text[pos - 1] in " \t\n;&|()<>":
                buf.append(text[seg:pos])
                j = text.find("\n", pos)
                seg = i = n if j < 0 else j
        elif c == "$" and text.startswith(("(", "{"), i):
            stack.append([text[i], 1])
            i += 1
        elif c == "<":
            h = _HEREDOC.match(text, pos)
            if h and not text.startswith("<<<", pos):
                heredocs.append((h.group(3), h.group(1) == "-"))
                i = h.end()
        elif c == "(" and kind == "(":
            stack[-1][1] += 1
        elif c == "(" and not kind and text.startswith("(", i):  # (( arithmetic )): its << is a shift
            stack.append(["(", 2])
            i += 1
        elif c in ")}" and kind == {")": "(", "}": "{"}[c]:
            stack[-1][1] -= 1
            if not stack[-1][1]:
                stack.pop()
        elif c == kind:  # a closing " or `
            stack.pop()
        elif c in '"`':
            stack.append([c, 1])


# a function definition: `function NAME`, `function NAME()` or `NAME()`, then `{` and maybe the body
_FUNCTION = re.compile(r"^(?:function\s+([A-Za-z_][\w:-]*)\s*(?:\(\s*\))?|([A-Za-z_][\w:-]*)\s*\(\s*\))\s*(\{)?(.*)$")
_CONTROL = re.compile(r"^(\|\|?|&&|;|&)$")  # a word that ends the command (a pipe, a list)
_REDIRECT = re.compile(r"^(\d*|&)>>?(&\d+|&-)?|^\d*<$")  # a redirection (`2>&1`, `>log`, `&>> log`, `<`)


def _script_index(words: list[str]) -> int | None:
    """Where the training script (``pretrain_*.py`` and the others Megatron-LM runs) is in ``words``."""
    return next(
        (
            k
            for k, w in enumerate(words)
            if (w.rsplit("/", 1)[-1].startswith("pretrain_") and w.endswith(".py"))
            or w.endswith("multimodal/train.py")  # Megatron-LM's vision-language trainer
            or w.rsplit("/", 1)[-1] == "finetune_gpt.py"  # Megatron-LM's GPT fine-tuning (detxoify_lm)
        ),
        None,
    )


def _command_words(words: list[str], shell: Shell, depth: int = 0) -> list[str]:
    """The words of the command that runs the training script among the commands of ``words`` (split
    at ``|``, ``&&``, ``||``, ``;``, ``&``), else of the first: see :func:`_simple_command`."""
    commands: list[list[str]] = [[]]
    for word in words:
        if _CONTROL.match(word):
            commands.append([])
        else:
            commands[-1].append(word)
    runs = [_simple_command(c, shell, depth) for c in commands if c]
    return next((c for c in runs if _script_index(c) is not None), runs[0] if runs else [])


def _simple_command(words: list[str], shell: Shell, depth: int) -> list[str]:
    """The words one command runs: redirections dropped; ``eval STRING...`` and ``sh|bash -c STRING``
    (after a launcher such as ``srun``) read their string as a script; ``echo``/``printf`` run nothing."""
    out: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        redirect = _REDIRECT.match(word)
        if redirect:
            skip = redirect.end() == len(word) and not redirect.group(2)  # `> FILE`: the target is the next word
            continue
        out.append(word)
    if out[:1] in (["echo"], ["printf"]):
        return []
    string = None
    if out[:1] == ["eval"]:
        string = " ".join(out[1:])
    shell_c = next((k for k, w in enumerate(out) if w.rsplit("/", 1)[-1] in ("sh", "bash")), None)
    if string is None and shell_c is not None:
        options = shell_c + 1
        while options < len(out) - 1 and out[options].startswith("-") and "c" not in out[options]:
            options += 1
        if re.fullmatch(r"-\w*c\w*", out[options] if options < len(out) - 1 else ""):
            string = out[options + 1]
    if string is None or depth >= 8:  # nested eval / sh -c: bounded
        return out
    runs = [
        _command_words(shell.words(piece), shell, depth + 1)
        for _, line in script_lines(string)
        for piece in _split_top(line, (";", "&&", "||"))[::2]
        if piece.strip()
    ]
    return next((c for c in runs if _script_index(c) is not None), runs[-1] if runs else [])


def launch_flags(text: str, shell: Shell) -> tuple[list[tuple[str, list[str]]], list[str], list[tuple[int, str]]]:
    """Run the assignments in ``text`` and return ``(flags, stray words, repaired lines)``.

    ``text`` is either the ``.args`` format (assignments, a ``# flags`` line, one flag per line)
    or a launch script: the flags are the words after ``pretrain_*.py`` on the first command
    that runs it (after expansion, so ``$CMD`` indirection works), plus the launcher's own
    ``--nproc_per_node``-style flags before it. Flags are ``(name, values)``; ``--a=b`` splits.
    Lines with an unbalanced quote are read without their quotes and listed as repaired.
    ``if`` blocks run only their taken branch (see the module docstring for the rules); raises
    :class:`~jaxpar.errors.ConfigError` when the command depends on a condition that is unknown.
    """
    args_format = any(line.strip() == "# flags" for line in text.splitlines())
    numbered = _lines(text, join=False) if args_format else script_lines(text)
    words: list[str] = []
    repaired: list[tuple[int, str]] = []
    in_flags = False
    array: list[str] | None = None  # lines of a NAME=( ... ) array being read
    depth = 0  # its "(" less its ")" so far
    array_line, array_name = 0, ""  # the line it starts on, its name (``NAME+`` for ``+=``)
    stack: list[_Frame] = []
    decided: list[str] = []  # variables decided by unknown conditions that other commands read

    def mode() -> tuple[str, _Unknown | None]:
        return (stack[-1].mode, stack[-1].unknown) if stack else ("run", None)

    def set_(name: str, raw: str, array_: bool = False) -> None:
        current, unknown = mode()
        if current == "skip":
            shell.read.update(re.findall(r"\$\{?#?([A-Za-z_]\w*)", raw))
        elif current == "taint":
            shell.taint(name, unknown)
        else:
            shell.assign(name, raw, words=array_)

    def append_array(name: str, value: str) -> None:
        """``NAME=( ... )`` or ``NAME+=( ... )`` (``name`` ends in ``+``), ``value`` inside the parentheses."""
        if name.endswith("+"):
            name = name[:-1]
            known = shell.env.get(name)
            if mode()[0] == "run" and known is not None and name not in shell.user and not unresolved_names(known):
                shell.append(name, value)  # only the new elements are read: linear in the appends
                return
            value = f"${{{name}[@]}} " + value
        set_(name, value, True)

    def case_clause(frame: _Frame, patterns: str) -> None:
        """A ``pattern|pattern)`` of ``frame``'s case: its commands run when it is the first to match."""
        frame.pattern = False
        if frame.fixed:
            return
        if not isinstance(frame.word, str):
            frame.mode, frame.unknown = "taint", frame.word
        elif frame.done:
            frame.mode, frame.unknown = "skip", None
        else:
            try:
                options = [shell.string(p.strip()) for p in _split_top(patterns, ("|",))[::2]]
            except UnbalancedQuote:
                options = [patterns]
            if any(unresolved_names(p) for p in options):
                frame.mode, frame.unknown = "taint", (f"a case pattern `{show(patterns)}` is unknown", None)
            elif any(fnmatch.fnmatchcase(frame.word, p) for p in options):
                frame.mode, frame.unknown, frame.done = "run", None, True
            else:
                frame.mode, frame.unknown = "skip", None

    def keyword(head: str, rest: str, number: int) -> None:
        current, unknown = mode()
        if head in ("while", "until", "for", "case"):
            kind = "case" if head == "case" else "loop"
            if current != "run":
                stack.append(_Frame(current, unknown, fixed=True, kind=kind))
                return
            if head == "case":
                frame = _Frame("skip", None, fixed=False, kind=kind)
                subject = rest[:-3] if rest.endswith(" in") else rest
                try:
                    word = shell.string(subject.strip())
                except UnbalancedQuote:
                    word = mark(subject)
                frame.word = _Condition(shell, f"case {rest}", number).reads(word) if unresolved_names(word) else word
                stack.append(frame)
                return
            value = True if head == "for" else _Condition(shell, rest, number).value()
            value = _not(value) if head == "until" else value
            if value is False:
                stack.append(_Frame("skip", None, fixed=False, kind=kind))
            else:
                why = value if not isinstance(value, bool) else None
                why = why or (f"line {number}: the loop `{head} {rest}` runs, and jaxpar does not run loops", None)
                stack.append(_Frame("taint", why, fixed=False, kind=kind))
            return
        if head in ("done", "esac"):
            if stack:
                stack.pop()
            return
        if head == ";;":
            if stack and stack[-1].kind == "case":
                stack[-1].pattern = True
            return
        if head == "if":
            if current != "run":
                stack.append(_Frame(current, unknown, fixed=True))
                return
            value = _Condition(shell, rest, number).value()
            if isinstance(value, bool):
                stack.append(_Frame("run" if value else "skip", None, fixed=False))
            else:
                stack.append(_Frame("taint", value, fixed=False))
            return
        if not stack:
            return
        frame = stack[-1]
        if head == "fi":
            stack.pop()
        elif frame.fixed or head in ("then", "do"):
            return
        elif frame.done:
            frame.mode, frame.unknown = "skip", None
        elif head == "else":
            frame.mode, frame.unknown = ("taint", frame.open_unknown) if frame.open_unknown else ("run", None)
            frame.done = frame.open_unknown is None
        else:  # elif
            value = _Condition(shell, rest, number).value()
            if value is False:
                frame.mode, frame.unknown = "skip", None
            elif frame.open_unknown or not isinstance(value, bool):
                frame.mode, frame.unknown = "taint", frame.open_unknown or value
                frame.open_unknown = frame.unknown
            else:
                frame.mode, frame.unknown, frame.done = "run", None, True

    functions: dict[str, list[tuple[int, str]]] = {}  # NAME() { ... }: the body's lines
    body: list[tuple[int, str]] | None = None  # the body of a definition being read
    body_name, body_depth, calls, called = "", 0, 0, 0  # calls made, lines of bodies they read
    saved: list[dict[str, str | None]] = []  # the positional arguments a call replaced
    todo: list[tuple[int, str | None]] = [*numbered[::-1]]  # lines to read, last first (a call pushes a body)
    while todo:
        number, line = todo.pop()
        if line is None:  # the end of a call's body: the caller's arguments again
            for key, value in saved.pop().items():
                if value is None:
                    shell.env.pop(key, None)
                else:
                    shell.env[key] = value
            continue
        stripped = line.strip()
        if body is not None:
            if stripped == "{" and body_depth == 0:  # NAME() on a line, { on the next
                body_depth = 1
                continue
            body_depth += stripped.endswith("{") - stripped.startswith("}")
            if body_depth <= 0 and stripped.startswith("}"):
                if mode()[0] == "run":
                    functions[body_name] = body
                body = None
            else:
                body.append((number, line))
            continue
        defined = None if args_format else _FUNCTION.match(stripped)
        if defined:
            body_name = defined.group(1) or defined.group(2)
            inline = defined.group(4).strip()
            if defined.group(3) and inline.endswith("}"):  # f() { A=1; }
                if mode()[0] == "run":
                    functions[body_name] = [(number, inline[:-1].strip().rstrip(";"))]
                continue
            body, body_depth = ([(number, inline)] if inline else []), 1 if defined.group(3) else 0
            continue
        if array is not None:
            array.append(stripped)
            depth += stripped.count("(") - stripped.count(")")  # counted per line: linear in the array
            if depth <= 0:
                value = " ".join(array).partition("=")[2]
                append_array(array_name, value.strip()[1:-1])
                array = None
            continue
        if stripped == "# flags":
            in_flags = True
            continue
        if not stripped or stripped.startswith("#"):
            continue
        found = False
        for statement in [stripped] if in_flags or args_format else _statements(stripped):
            frame = stack[-1] if stack else None
            if frame is not None and frame.kind == "case" and frame.pattern and statement != "esac":
                clause = _CLAUSE.match(statement)
                if clause is None:
                    raise ConfigError(f"megatron: line {number}: `{statement[:80]}` is not a case pattern `PATTERN)`")
                case_clause(frame, clause.group(1))
                statement = clause.group(2).strip()
                if not statement:
                    continue
            head, _, rest = statement.partition(" ")
            if not in_flags and not args_format and head in _KEYWORDS:
                keyword(head, rest.strip(), number)
                continue
            appended = None if in_flags else _APPEND.match(statement)
            if appended and not args_format and not appended.group(2).startswith("("):
                name, raw = appended.groups()
                set_(name, f'"${{{name}}}"' + raw)
                continue
            assignment = None if in_flags else split_assignment(statement) or (appended and appended.groups())
            if assignment and assignment[1].startswith("(") and not args_format:
                array, array_line = [statement], number
                depth = statement.count("(") - statement.count(")")
                array_name = assignment[0] + ("+" if appended else "")
                if depth <= 0:
                    append_array(array_name, assignment[1].strip()[1:-1])
                    array = None
                continue
            if assignment:
                set_(*assignment)
                continue
            if args_format and not in_flags:
                continue
            current, unknown = mode()
            if current == "skip":
                continue
            if head in functions:  # a call: the body runs here, with the call's words as $1, $2, ...
                calls += 1
                called += len(functions[head])
                if calls > 1000 or called > 4 * len(numbered) + 10_000:  # bounded: linear in the script
                    raise ConfigError(
                        f"megatron: line {number}: over 1000 function calls or {4 * len(numbered) + 10_000} lines "
                        "read through them (recursion?); unfold them"
                    )
                args = shell.words(rest)
                positional = [str(k) for k in range(1, max(len(args), int(shell.env.get("#", "0") or 0)) + 1)]
                saved.append({k: shell.env.get(k) for k in ["#", *positional]})
                shell.env.update({"#": str(len(args)), **{str(k): a for k, a in enumerate(args, 1)}})
                for k in positional[len(args) :]:
                    shell.env.pop(k, None)
                todo += [(number, None), *functions[head][::-1]]
                break  # the rest of this line is lost only for `f; g` on one line
            try:
                line_words = shell.words(statement)
            except UnbalancedQuote:
                line_words = shell.words(statement.replace('"', "").replace("'", ""))
                repaired.append((number, statement))
            if in_flags:
                words += line_words
                continue
            line_words = _command_words(line_words, shell)
            if line_words[:1] == ["unset"]:
                for name in (w for w in line_words[1:] if _NAME.fullmatch(w) and w not in shell.user):
                    if current == "taint":
                        shell.taint(name, unknown)
                    else:
                        shell.env.pop(name, None)
                        shell.cleared.add(name)
            if line_words[:1] in (["mkdir"], ["touch"]) and current == "run":
                for path in line_words[1:]:
                    if not path.startswith("-") and not unresolved_names(path):
                        shell.exists[path.rstrip("/") or "/"] = "d" if line_words[0] == "mkdir" else "f"
            script = _script_index(line_words)
            if script is not None and current == "taint":
                raise ConfigError(
                    f"megatron: {unknown[0]}, and the pretrain command on line {number} runs only in one of its "
                    f"branches; pass --var {unknown[1] or 'NAME'}=VALUE"
                )
            if line_words[:1] == ["exit"] and current == "run" and stack:
                raise ConfigError(
                    f"megatron: line {number}: the script exits here (`{statement}`), before any pretrain_*.py "
                    "command, because the enclosing condition holds; check the --var values"
                )
            if script is None and current == "run":
                decided += [n for w in line_words for n in unresolved_names(w) if n in shell.conditions]
            if script is not None:
                shell.script = line_words[script].rsplit("/", 1)[-1]
                first = next((k for k, w in enumerate(line_words[:script]) if w.startswith("--")), script)
                words = line_words[first:script] + line_words[script + 1 :]
                found = True
                break
        if found:
            break
    else:  # no pretrain command: one may hide in a variable an unknown condition decides ($CMD, eval)
        if body is not None:
            raise ConfigError(
                f"megatron: the function {body_name[:80]}'s body is never closed (bash: unexpected end of file); "
                "add its closing '}'"
            )
        if array is not None:
            raise ConfigError(
                f"megatron: line {array_line}: the array {array[0].partition('=')[0][:80]}=( is never closed "
                "(bash: unexpected end of file); add its closing ')'"
            )
        words += [mark(n) for n in decided[:1]]
    for word in words:
        for name in unresolved_names(word):
            if name in shell.conditions:
                what, var = shell.conditions[name]
                fix = f"--var {var}=VALUE" if var else f"--var {name}=VALUE"
                raise ConfigError(
                    f"megatron: {what}, and it decides ${name}, which the launch command reads; pass {fix}"
                )
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
