"""``if`` / ``while`` conditions of launch scripts evaluated as bash would, or *unknown* (with what they
read) when a value they need is not known."""

from __future__ import annotations

import ast
import fnmatch
import re

from jaxpar.port.bash_lines import split_top
from jaxpar.port.bash_words import Shell, UnbalancedQuote, evaluate, unresolved_names

Unknown = tuple  # (what is unknown, the variable to pass with --var or None): a condition's third value
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
NAME = re.compile(r"[A-Za-z_]\w*|\d+")


class Condition:
    """One ``if``/``elif`` condition of line ``number``: True, False or an unknown (``Unknown``)."""

    def __init__(self, shell: Shell, text: str, number: int) -> None:
        self.shell, self.text, self.number = shell, text, number

    def value(self) -> bool | Unknown:
        try:
            pieces = split_top(self.text, ("&&", "||"))
        except UnbalancedQuote:
            return self.form()
        result = self.command(pieces[0])
        for op, piece in zip(pieces[1::2], pieces[2::2], strict=True):
            result = _and(result, self.command(piece)) if op == "&&" else _or(result, self.command(piece))
        return result

    def form(self) -> Unknown:
        return (
            f"line {self.number}: the condition `{self.text}` is not a form jaxpar evaluates "
            "([ ], [[ ]], test, (( )), true, false)",
            None,
        )

    def reads(self, word: str) -> Unknown:
        name = unresolved_names(word)[0]
        why = self.shell.why.get(name, "not set")
        var = name if NAME.fullmatch(name) else None
        return (f"line {self.number}: the condition `{self.text}` reads ${name}, which is unknown ({why})", var)

    def command(self, piece: str) -> bool | Unknown:
        piece = piece.strip()
        if piece.startswith("!") and piece[1:2].isspace():
            return not_(self.command(piece[1:]))
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

    def arith(self, expr: str) -> bool | Unknown:
        expanded = self.shell.string(expr)
        expanded = re.sub(r"[A-Za-z_]\w*", lambda m: self.shell.var(m.group(0)), expanded)
        if unresolved_names(expanded):
            return self.reads(expanded)
        py = expanded.replace("&&", " and ").replace("||", " or ")
        py = re.sub(r"!(?!=)", " not ", py)
        if not re.fullmatch(r"[\d\s+\-*/%()<>=!a-z]*", py):
            return self.form()
        try:
            return evaluate(ast.parse(py.strip(), mode="eval").body) != 0
        except (SyntaxError, ZeroDivisionError, ValueError):
            return self.form()

    def test(self, words: list[str], and_: str, or_: str) -> bool | Unknown:
        """``test`` / ``[[ ]]`` expression over expanded ``words`` (three-valued, so an unknown
        side that cannot change the result does not make the whole unknown)."""
        double = and_ == "&&"
        pos = 0

        def peek(k: int = 0) -> str | None:
            return words[pos + k] if pos + k < len(words) else None

        def disjunction() -> bool | Unknown:
            nonlocal pos
            value = conjunction()
            while peek() == or_:
                pos += 1
                value = _or(value, conjunction())
            return value

        def conjunction() -> bool | Unknown:
            nonlocal pos
            value = negation()
            while peek() == and_:
                pos += 1
                value = _and(value, negation())
            return value

        def negation() -> bool | Unknown:
            nonlocal pos
            if peek() == "!" and peek(1) is not None:
                pos += 1
                return not_(negation())
            if peek() == "(":
                pos += 1
                value = disjunction()
                if peek() != ")":
                    raise ValueError
                pos += 1
                return value
            return primary()

        def primary() -> bool | Unknown:
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

        def compare(left: str, op: str, right: str) -> bool | Unknown:
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


def not_(v: bool | Unknown) -> bool | Unknown:
    return (not v) if isinstance(v, bool) else v


def _and(a: bool | Unknown, b: bool | Unknown) -> bool | Unknown:
    if a is False or b is False:
        return False
    return a if not isinstance(a, bool) else b


def _or(a: bool | Unknown, b: bool | Unknown) -> bool | Unknown:
    if a is True or b is True:
        return True
    return a if not isinstance(a, bool) else b
