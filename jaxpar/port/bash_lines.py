"""Launch-script text -> logical lines and statements as bash forms them: continuations, quotes,
heredocs, comments, ``;``-separated statements and assignments."""

from __future__ import annotations

import re

from jaxpar.port.bash_words import ASSIGN, UnbalancedQuote


def split_top(text: str, seps: tuple[str, ...]) -> list[str]:
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


def split_assignment(line: str) -> tuple[str, str] | None:
    """``(name, raw value)`` when ``line`` is a shell variable assignment, else None."""
    m = ASSIGN.match(line.strip())
    return (m.group(1), m.group(2)) if m else None


KEYWORDS = ("if", "then", "elif", "else", "fi", "while", "until", "for", "do", "done", "case", "esac", ";;")
CLAUSE = re.compile(r"^\(?\s*([^()]*?)\s*\)\s*(.*)$", re.S)  # a case clause: `pattern|pattern) commands`
APPEND = re.compile(r"^([A-Za-z_]\w*)\+=(.*)$", re.S)


def statements(line: str) -> list[str]:
    """``line`` as statements when it holds a keyword of :data:`KEYWORDS` (split at ``;``, ``;;`` kept
    as a statement, and after ``then``/``else``/``do``), else the line itself (kept whole, as before)."""
    try:
        pieces = split_top(line, (";;", ";"))
    except UnbalancedQuote:
        return [line]
    parts = [p.strip() for k, p in enumerate(pieces) for p in ([p] if k % 2 == 0 else [";;"] if p == ";;" else [])]
    if not any(p.split(None, 1)[:1] and p.split(None, 1)[0] in KEYWORDS for p in parts):
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


def numbered_lines(text: str, join: bool) -> list[tuple[int, str]]:
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
            return out + [(number + k - 1, part) for k, part in numbered_lines(text[i:], join=True)]
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
