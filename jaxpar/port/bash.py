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

import fnmatch
import re

from jaxpar.errors import ConfigError
from jaxpar.port.bash_condition import NAME, Condition, Unknown, not_
from jaxpar.port.bash_lines import APPEND, CLAUSE, KEYWORDS, numbered_lines, split_top, statements
from jaxpar.port.bash_lines import script_lines as script_lines
from jaxpar.port.bash_lines import split_assignment as split_assignment
from jaxpar.port.bash_words import Shell as Shell
from jaxpar.port.bash_words import UnbalancedQuote, mark
from jaxpar.port.bash_words import show as show
from jaxpar.port.bash_words import unresolved_names as unresolved_names


class _Frame:
    """One open ``if`` block: the mode of its current branch (``run``, ``skip``, ``taint``)."""

    def __init__(self, mode: str, unknown: Unknown | None, fixed: bool, kind: str = "if") -> None:
        self.mode, self.unknown, self.fixed, self.kind = mode, unknown, fixed, kind
        self.word: str | Unknown = ""  # a case's word (expanded), or why it is unknown
        self.pattern = kind == "case"  # a case expects a `pattern)` next
        self.done = mode == "run"  # a branch was taken: later ones are skipped
        self.open_unknown = unknown if mode == "taint" else None  # an earlier condition was unknown


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
        for piece in split_top(line, (";", "&&", "||"))[::2]
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
    numbered = numbered_lines(text, join=False) if args_format else script_lines(text)
    words: list[str] = []
    repaired: list[tuple[int, str]] = []
    in_flags = False
    array: list[str] | None = None  # lines of a NAME=( ... ) array being read
    depth = 0  # its "(" less its ")" so far
    array_line, array_name = 0, ""  # the line it starts on, its name (``NAME+`` for ``+=``)
    stack: list[_Frame] = []
    decided: list[str] = []  # variables decided by unknown conditions that other commands read

    def mode() -> tuple[str, Unknown | None]:
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
                options = [shell.string(p.strip()) for p in split_top(patterns, ("|",))[::2]]
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
                frame.word = Condition(shell, f"case {rest}", number).reads(word) if unresolved_names(word) else word
                stack.append(frame)
                return
            value = True if head == "for" else Condition(shell, rest, number).value()
            value = not_(value) if head == "until" else value
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
            value = Condition(shell, rest, number).value()
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
            value = Condition(shell, rest, number).value()
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
        for statement in [stripped] if in_flags or args_format else statements(stripped):
            frame = stack[-1] if stack else None
            if frame is not None and frame.kind == "case" and frame.pattern and statement != "esac":
                clause = CLAUSE.match(statement)
                if clause is None:
                    raise ConfigError(f"megatron: line {number}: `{statement[:80]}` is not a case pattern `PATTERN)`")
                case_clause(frame, clause.group(1))
                statement = clause.group(2).strip()
                if not statement:
                    continue
            head, _, rest = statement.partition(" ")
            if not in_flags and not args_format and head in KEYWORDS:
                keyword(head, rest.strip(), number)
                continue
            appended = None if in_flags else APPEND.match(statement)
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
                for name in (w for w in line_words[1:] if NAME.fullmatch(w) and w not in shell.user):
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
