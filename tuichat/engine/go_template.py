"""Ollama's chat templates (Go's text/template) as Jinja chat templates, for a GGUF of Ollama's store whose
file holds no Jinja template of its own: transformers then renders it as it renders any model's template.

Written by hand because no library converts them. It covers what Ollama's templates use: `if`/`else if`/
`else`, `range` (with `$i, $m :=`), `with`, variables, `.Field` and `$.Field`, the functions eq, ne, lt, le,
gt, ge, and, or, not, len, slice, index and json, pipes, and the trim markers. The data are Ollama's: `.System`
(the system messages joined), `.Messages` (each `.Role`, `.Content`, `.ToolCalls`), `.Tools`, and for the
older templates without `.Messages`, one execution per turn with `.System`, `.Prompt` and `.Response`, the last
one cut at `.Response`, as Ollama runs them.
"""

from __future__ import annotations

import re

from tuichat.engine.types import TuichatError

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.DOTALL)
_TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*"|`[^`]*`)|(-?\d+(?:\.\d+)?)|(\$[A-Za-z_]\w*|\$)((?:\.[A-Za-z_]\w*)*)'
                    r'|((?:\.[A-Za-z_]\w*)+|\.)|([A-Za-z_]\w*)|(\(|\)|\|))')
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}

# Ollama's values, built from transformers' `messages`: system messages joined for `.System` (and kept in
# `.Messages`); a message's role and text under Ollama's names.
_PRELUDE = (
    "{%- set _ns = namespace(system=[], messages=[]) -%}"
    "{%- for _m in messages -%}"
    "{%- if _m.role == 'system' %}{% set _ns.system = _ns.system + [_m.content] %}{% endif -%}"
    "{%- set _ns.messages = _ns.messages + [{'Role': _m.role, 'Content': _m.content, 'ToolCalls': []}] -%}"
    "{%- endfor -%}"
    "{%- set System = _ns.system | join('\\n\\n') -%}"
    "{%- set Messages = _ns.messages -%}{%- set Tools = [] -%}{%- set Prompt = '' -%}{%- set Response = '' %}"
)
# An older template runs once a turn, with the turn's system message, the user's and the reply, as Ollama's
# template.Execute collects them: a system message or a user's after a reply closes the turn before it.
_FLUSH = ("{% set _t.turns = _t.turns + [[_t.system, _t.prompt, _t.response]] %}"
          "{% set _t.system = '' %}{% set _t.prompt = '' %}{% set _t.response = '' %}")
_TURNS = (
    "{%- set _t = namespace(turns=[], system='', prompt='', response='') -%}"
    "{%- for _m in messages -%}"
    "{%- if _m.role == 'system' -%}"
    "{%- if _t.prompt or _t.response %}" + _FLUSH + "{% endif -%}"
    "{%- set _t.system = _m.content -%}"
    "{%- elif _m.role == 'user' -%}"
    "{%- if _t.response %}" + _FLUSH + "{% endif -%}"
    "{%- set _t.prompt = _m.content -%}"
    "{%- elif _m.role == 'assistant' %}{% set _t.response = _m.content %}{% endif -%}"
    "{%- endfor -%}"
    "{%- set _t.turns = _t.turns + [[_t.system, _t.prompt, _t.response]] -%}"
    "{%- for _turn in _t.turns -%}"
    "{%- set System = _turn[0] %}{% set Prompt = _turn[1] %}{% set Response = _turn[2] -%}"
    "{%- set Messages = [] %}{% set Tools = [] %}{% set _last = loop.last %}"
)


def to_jinja(source: str) -> str:
    """The Jinja chat template that renders as Ollama renders the Go template `source`; TuichatError for what
    this subset cannot read."""
    try:
        return _Translator(source).run()
    except (IndexError, ValueError) as exc:
        raise TuichatError(f"Ollama's chat template could not be read: {exc}") from exc


class _Translator:
    def __init__(self, source: str):
        self.source = source
        self.out: list[str] = []
        self.blocks: list[tuple[str, str | None]] = []  # (what closes it, the name of its dot, where it changes it)
        self.dots: list[str] = ["$"]  # Go's dot: "$" is the top level, whose fields are the prelude's names
        self.fresh = 0
        self.legacy = not re.search(r"\.Messages\b", source)
        self.cut = False

    def run(self) -> str:
        # Go's trim markers are applied here, to the text beside them; all text is then written as Jinja string
        # literals, so that transformers' trim_blocks and lstrip_blocks find no text to trim.
        parts: list[list] = []
        at = 0
        for match in _ACTION.finditer(self.source):
            parts.append(["text", self.source[at:match.start()]])
            parts.append(["action", match.group(2).strip(), bool(match.group(1)), bool(match.group(3))])
            at = match.end()
        parts.append(["text", self.source[at:]])
        for i, part in enumerate(parts):
            if part[0] == "action":
                if part[2]:
                    parts[i - 1][1] = parts[i - 1][1].rstrip()
                if part[3]:
                    parts[i + 1][1] = parts[i + 1][1].lstrip()
        for part in parts:
            if part[0] == "text":
                if part[1]:
                    self.out.append("{{ " + repr(part[1]) + " }}")
            elif not part[1].startswith("/*"):  # a comment: only its trim markers act
                self.action(part[1])
        if self.blocks:
            raise ValueError(f"{len(self.blocks)} block(s) without their {{{{ end }}}}")
        body = "".join(self.out)
        if not self.legacy:
            return _PRELUDE + body
        if not self.cut:
            raise ValueError("a template without .Messages must write .Response")
        return _TURNS + body + "{% endif %}{% endfor %}"

    def tag(self, inner: str) -> None:
        self.out.append(f"{{% {inner} %}}")

    def action(self, body: str) -> None:
        word = body.split(None, 1)[0] if body else ""
        rest = body[len(word):].strip()
        if word == "if":
            self.tag(f"if {self.expression(rest)}")
            self.blocks.append(("endif", None))
        elif word == "else" and rest.startswith("if "):
            self.tag(f"elif {self.expression(rest[3:])}")
        elif word == "else" and rest.startswith("with "):
            raise ValueError("else with is not read")
        elif word == "else":
            self.tag("else")
        elif word == "end":
            close, dot = self.blocks.pop()
            if dot is not None:
                self.dots.pop()
            self.tag(close)
        elif word == "range":
            names, _, over = rest.rpartition(":=") if ":=" in rest else ("", "", rest)
            variables = [v.strip() for v in names.split(",")] if names else []
            self.fresh += 1
            item = f"_r{self.fresh}"
            self.tag(f"for {item} in {self.expression(over)}")
            for variable, value in zip(variables[-2:] if len(variables) == 2 else [], ("loop.index0", item), strict=False):
                if variable != "$_":
                    self.out.append(f"{{% set {self.variable(variable)} = {value} %}}")
            if len(variables) == 1 and variables[0] != "$_":
                self.out.append(f"{{% set {self.variable(variables[0])} = {item} %}}")
            self.dots.append(item)
            self.blocks.append(("endfor", item))
        elif word == "with":
            self.fresh += 1
            item = f"_w{self.fresh}"
            self.out.append(f"{{% set {item} = {self.expression(rest)} %}}")
            self.tag(f"if {item}")
            self.dots.append(item)
            self.blocks.append(("endif", item))
        elif re.match(r"\$\w+\s*:?=", body):
            variable, _, value = body.partition("=")
            self.tag(f"set {self.variable(variable.rstrip(':').strip())} = {self.expression(value)}")
        elif word in ("template", "define", "block", "break", "continue"):
            raise ValueError(f"{{{{ {word} }}}} is not read")
        else:
            if self.legacy and re.fullmatch(r"\$?\.Response", body):
                if self.blocks:
                    raise ValueError(".Response inside a block")
                self.out.append("{{ Response }}{% if not _last %}")
                self.cut = True
                return
            self.out.append(f"{{{{ {self.expression(body)} }}}}")

    @staticmethod
    def variable(name: str) -> str:
        return "_v_" + name.lstrip("$")

    def expression(self, text: str) -> str:
        tokens, at = [], 0
        text = text.strip()
        while at < len(text):
            match = _TOKEN.match(text, at)
            if match is None or match.end() == at:
                raise ValueError(f"cannot read {text[at:]!r}")
            tokens.append(match)
            at = match.end()
        result, rest = self.pipeline(tokens)
        if rest:
            raise ValueError(f"cannot read {text!r}")
        return result

    def pipeline(self, tokens: list) -> tuple[str, list]:
        value, tokens = self.command(tokens)
        while tokens and tokens[0].group(7) == "|":
            function, tokens = tokens[1].group(6), tokens[2:]
            args, tokens = self.operands(tokens)
            value = self.call(function, [*args, value])
        return value, tokens

    def command(self, tokens: list) -> tuple[str, list]:
        if tokens and tokens[0].group(6) and tokens[0].group(6) not in ("true", "false", "nil"):
            function = tokens[0].group(6)
            args, tokens = self.operands(tokens[1:])
            return self.call(function, args), tokens
        args, tokens = self.operands(tokens)
        if len(args) != 1:
            raise ValueError("a value was expected")
        return args[0], tokens

    def operands(self, tokens: list) -> tuple[list[str], list]:
        args = []
        while tokens and tokens[0].group(7) != "|" and tokens[0].group(7) != ")":
            token, tokens = tokens[0], tokens[1:]
            string, number, variable, fields, dotted, word, punct = token.groups()[:7]
            if punct == "(":
                value, tokens = self.pipeline(tokens)
                if not tokens or tokens[0].group(7) != ")":
                    raise ValueError("a ( without its )")
                tokens = tokens[1:]
                args.append(f"({value})")
            elif string is not None:
                args.append(repr(string[1:-1].encode().decode("unicode_escape") if string[0] == '"' else string[1:-1]))
            elif number is not None:
                args.append(number)
            elif variable is not None:  # $.A.B from the top level, $x.A.B from a variable
                args.append(self.field("$" if variable == "$" else self.variable(variable), fields))
            elif dotted is not None:  # .A.B from Go's dot where it is now
                args.append(self.field(self.dots[-1], dotted))
            elif word in ("true", "false"):
                args.append(word)
            elif word == "nil":
                args.append("none")
            else:
                raise ValueError(f"{word} in an argument")
        return args, tokens

    @staticmethod
    def field(base: str, fields: str) -> str:
        """`fields` (".A.B", or "" / "." for the value itself) of `base`: the top level's fields are the names the
        prelude sets."""
        names = [n for n in fields.split(".") if n]
        if base == "$" and not names:
            raise ValueError("the top level's value itself is not read")
        return ".".join(names if base == "$" else [base, *names])

    @staticmethod
    def call(function: str, args: list[str]) -> str:
        if function in _COMPARE:
            if function == "eq" and len(args) > 2:
                return "(" + " or ".join(f"{args[0]} == {b}" for b in args[1:]) + ")"
            return f"({args[0]} {_COMPARE[function]} {args[1]})"
        if function in ("and", "or"):
            return "(" + f" {function} ".join(args) + ")"
        if function == "not":
            return f"(not {args[0]})"
        if function == "len":
            return f"({args[0]} | length)"
        if function == "slice":
            return f"{args[0]}[{args[1] if len(args) > 1 else ''}:{args[2] if len(args) > 2 else ''}]"
        if function == "index":
            return args[0] + "".join(f"[{a}]" for a in args[1:])
        if function == "json":
            return f"({args[0]} | tojson)"
        if function == "print":
            return "(" + " ~ ".join(f"({a} | string)" for a in args) + ")"
        raise ValueError(f"the function {function} is not read")
