"""Read textual IR, as :func:`rlx.ir.printer.format_graph` prints it, back into a :class:`Graph`.

Grammar (one statement per line; blank lines and ``//`` comments are skipped)::

    graph     ::= 'graph' SYMBOL '{'  statement*  '}'
    statement ::= input | op | output
    input     ::= VALUE '=' 'input' STRING ':' type
    op        ::= VALUE (',' VALUE)* '=' OPNAME [VALUE (',' VALUE)*] [attrs] ':' type (',' type)*
    output    ::= 'output' NAME '=' VALUE (',' NAME '=' VALUE)*
    attrs     ::= '{' [NAME '=' attr_value (',' NAME '=' attr_value)*] '}'
    type      ::= DTYPE '[' [DIM (',' DIM)*] ']'      DIM: INT or a symbol name (dynamic size)

    SYMBOL = '@' name, VALUE = '%' name, attr_value = tokens up to ',' or '}' outside brackets,
    STRING = a JSON string literal (the printer quotes every str attribute value this way).

Nodes are built with the public builder (``Graph.input``, ``Graph.add_node``, ``Graph.output``), so
parsed text gets exactly the shape checks Python code gets. Attribute values are converted by the
annotated type of the attrs dataclass field of the same name, so a new op with a new attrs class
parses without a parser change. Every error is an ``RlxValueError`` naming the line and column.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

from rlx.errors import RlxError, RlxTypeError, RlxValueError
from rlx.ir.dims import parse_dim
from rlx.ir.graph import Graph, Value
from rlx.ir.ops import OpKind
from rlx.ir.types import DTYPE_NAMES, Layout, MaskKind, TensorType, Wrt

_PUNCTUATION = "=,:{}[]()|-+*"
_OPENERS = {"(": ")", "[": "]", "{": "}"}

# ----------------------------------------------------------------------------- tokens


@dataclass(frozen=True)
class Token:
    """One lexeme; ``text`` is the exact source text (strings keep their quotes)."""

    kind: str  # "name", "value" (%x), "symbol" (@x), "number", "string", "punct" or "end"
    text: str
    line: int
    column: int

    @property
    def string_value(self) -> str:
        """The content of a string token, JSON escapes (``\\"``, ``\\\\``, ``\\n``, ``\\u00e9``) decoded."""
        return _decode_string(self.text)

    def describe(self) -> str:
        return "end of line" if self.kind == "end" else repr(self.text)


def _is_name_char(char: str) -> bool:
    return char.isascii() and (char.isalnum() or char in "_.")


def _decode_string(text: str) -> str:
    """Decode a quoted string token as JSON; raw control characters (a tab) are allowed."""
    value = json.loads(text, strict=False)
    if not isinstance(value, str):  # cannot happen for a token that starts and ends with '"'
        raise ValueError(f"not a string: {text}")
    return value


def _error(line: int, column: int, message: str) -> RlxValueError:
    return RlxValueError(f"line {line}, column {column}: {message}")


def tokenize_line(source: str, line: int) -> list[Token]:
    """Split one line into tokens, ending with an ``end`` token; ``//`` starts a comment."""
    tokens: list[Token] = []
    i = 0
    while i < len(source):
        char = source[i]
        if char.isspace():
            i += 1
            continue
        if source.startswith("//", i):
            break
        end = _token_end(source, i, line)
        tokens.append(Token(_token_kind(source, i), source[i:end], line, i + 1))
        i = end
    tokens.append(Token("end", "", line, len(source) + 1))
    return tokens


def _token_kind(source: str, i: int) -> str:
    char = source[i]
    if char in "%@":
        return "value" if char == "%" else "symbol"
    if char == '"':
        return "string"
    if _digit_at(source, i) or (char == "-" and _digit_at(source, i + 1)):
        return "number"
    if _is_name_char(char):
        return "name"
    return "punct"


def _token_end(source: str, i: int, line: int) -> int:
    """Index just past the token starting at ``source[i]``."""
    char = source[i]
    kind = _token_kind(source, i)
    if kind in ("value", "symbol"):
        end = _skip(source, i + 1, _is_name_char)
        if end == i + 1:
            raise _error(line, i + 1, f"expected a name after {char!r}")
        return end
    if kind == "string":
        return _string_end(source, i, line)
    if kind == "number":
        return _number_end(source, i)
    if kind == "name":
        return _skip(source, i, _is_name_char)
    if char in _PUNCTUATION:
        return i + 1
    raise _error(line, i + 1, f"unexpected character {char!r}")


def _skip(source: str, i: int, accept: Callable[[str], bool]) -> int:
    while i < len(source) and accept(source[i]):
        i += 1
    return i


def _digit_at(source: str, i: int) -> bool:
    return i < len(source) and source[i].isascii() and source[i].isdigit()


def _number_end(source: str, i: int) -> int:
    """Integers and floats as Python prints them: ``-12``, ``0.5``, ``1e-09``."""
    is_digit = lambda c: c.isascii() and c.isdigit()  # noqa: E731
    i = _skip(source, i + 1 if source[i] == "-" else i, is_digit)
    if i < len(source) and source[i] == ".":
        i = _skip(source, i + 1, is_digit)
    if i < len(source) and source[i] in "eE":
        j = i + 1 + (i + 1 < len(source) and source[i + 1] in "+-")
        if _digit_at(source, j):
            i = _skip(source, j, is_digit)
    return i


def _string_end(source: str, i: int, line: int) -> int:
    j = i + 1
    while j < len(source):
        if source[j] == "\\":
            j += 2
            continue
        if source[j] == '"':
            try:
                _decode_string(source[i : j + 1])
            except ValueError:
                escapes = r"\", \\, \/, \b, \f, \n, \r, \t or \uXXXX"
                raise _error(line, i + 1, f"bad escape in string {source[i : j + 1]}; expected {escapes}") from None
            return j + 1
        j += 1
    raise _error(line, i + 1, "unterminated string")


# ----------------------------------------------------------------------------- one line


class _Cursor:
    """Reads the tokens of one line, raising errors that name what was expected."""

    def __init__(self, tokens: list[Token]) -> None:
        self.tokens = tokens
        self.pos = 0

    def peek(self) -> Token:
        return self.tokens[self.pos]

    def next(self) -> Token:
        token = self.tokens[self.pos]
        if token.kind != "end":
            self.pos += 1
        return token

    def at(self, text: str) -> bool:
        token = self.peek()
        return token.kind in ("punct", "name") and token.text == text

    def at_kind(self, kind: str) -> bool:
        return self.peek().kind == kind

    def accept(self, text: str) -> bool:
        if self.at(text):
            self.next()
            return True
        return False

    def expect(self, text: str, context: str = "") -> Token:
        if not self.at(text):
            raise self.error(f"{text!r}{context}")
        return self.next()

    def expect_kind(self, kind: str, expected: str) -> Token:
        if self.peek().kind != kind:
            raise self.error(expected)
        return self.next()

    def expect_end(self) -> None:
        if self.peek().kind != "end":
            raise self.error("end of line")

    def error(self, expected: str, token: Token | None = None) -> RlxValueError:
        token = token or self.peek()
        return _error(token.line, token.column, f"expected {expected}, got {token.describe()}")


# ----------------------------------------------------------------------------- attribute values


def _parse_int(text: str) -> int:
    if not text.lstrip("-").isdigit() or not text.isascii():
        raise ValueError(f"not an int: {text!r}")
    return int(text)


def _parse_bool(text: str) -> bool:
    if text not in ("True", "False"):
        raise ValueError(f"not a bool: {text!r}")
    return text == "True"


# Field type -> converter from the attribute's text. Other enums match a member's value or name;
# other classes with a ``parse(text)`` static method use it.
_CONVERTERS: dict[type, Callable[[str], object]] = {
    MaskKind: MaskKind.parse,
    Wrt: Wrt.parse,
    Layout: Layout,
    int: _parse_int,
    float: float,
    bool: _parse_bool,
}


def _describe_type(tp: object) -> str:
    name = str(getattr(tp, "__name__", tp))
    article = "an" if name[:1] in ("a", "e", "i", "o", "u") else "a"
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and not issubclass(tp, enum.Flag):
        return f"{article} {name} ({' or '.join(str(m) for m in tp)})"
    return f"{article} {name}"


def _convert(tp: object, tokens: list[Token]) -> object:
    """Turn an attribute's tokens into a value of field type ``tp``; ValueError if it does not fit."""
    text = "".join(token.text for token in tokens)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return _convert_union(typing.get_args(tp), tokens, text)
    if tp is str:
        if len(tokens) != 1 or tokens[0].kind not in ("name", "string"):
            raise ValueError("expected a name or a quoted string")
        return tokens[0].string_value if tokens[0].kind == "string" else text
    if typing.get_origin(tp) is tuple:
        return _convert_int_tuple(tp, tokens, text)
    if tp in _CONVERTERS:
        return _CONVERTERS[tp](text)  # type: ignore[index]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if text in (str(member.value), member.name, str(member)):
                return member
        raise ValueError(f"no {tp.__name__} spelled {text!r}")
    parse_method = getattr(tp, "parse", None)
    if callable(parse_method):
        return parse_method(text)
    raise ValueError(f"the parser does not know how to read a {tp}")


def _convert_int_tuple(tp: object, tokens: list[Token], text: str) -> tuple[int | str, ...]:
    """``(1, 2)``, ``(3,)`` or ``()`` for a ``tuple[int, ...]`` field; a shape field
    (``tuple[int | str, ...]``) also reads symbolic dimensions, ``(2, Sk, 64)``."""
    args = typing.get_args(tp)
    shape = args == (int | str, Ellipsis)
    if args != (int, Ellipsis) and not shape:
        raise ValueError(f"the parser reads tuples of ints (and shapes) only, not {tp}")
    if not (text.startswith("(") and text.endswith(")")):
        raise ValueError("expected a tuple like (1, 2)")
    entries: list[list[Token]] = [[]]
    for token in tokens[1:-1]:
        if token.text == ",":
            entries.append([])
        else:
            entries[-1].append(token)
    if entries[-1] == []:  # "()" and a trailing comma, "(3,)"
        entries.pop()
    parsed: list[int | str] = []
    for entry in entries:
        if len(entry) == 1 and entry[0].kind == "number":
            parsed.append(_parse_int(entry[0].text))
            continue
        # Sk, or a product such as 2*Sk (a product of ints alone is not a symbolic dimension); the
        # tokens are joined by spaces, so two names without a "*" between them are not one name
        dim = parse_dim(" ".join(token.text for token in entry)) if shape else None
        if not isinstance(dim, str):
            raise ValueError("expected ints between the parentheses" + (" (or symbolic dimensions)" if shape else ""))
        parsed.append(dim)
    return tuple(parsed)


def _convert_union(options: tuple[object, ...], tokens: list[Token], text: str) -> object:
    if text == "None" and type(None) in options:
        return None
    failures = []
    for option in options:
        if option is type(None):
            continue
        try:
            return _convert(option, tokens)
        except (ValueError, TypeError) as exc:
            failures.append(str(exc))
    raise ValueError("; ".join(failures))


# ----------------------------------------------------------------------------- the graph


class _Parser:
    """Builds one graph from the lines of its text, keeping the printed value names."""

    def __init__(self, text: str) -> None:
        self.lines = [(n, tokenize_line(src, n)) for n, src in enumerate(text.splitlines(), start=1)]
        self.lines = [(n, tokens) for n, tokens in self.lines if tokens[0].kind != "end"]
        self.last_line = max(len(text.splitlines()), 1)
        self.graph: Graph | None = None
        self.values: dict[str, Value] = {}
        self.defined_on: dict[str, int] = {}

    def parse(self) -> Graph:
        if not self.lines:
            raise _error(1, 1, "expected 'graph @name {', got an empty text")
        graph = self._header(_Cursor(self.lines[0][1]))
        for index, (_, tokens) in enumerate(self.lines[1:], start=1):
            cursor = _Cursor(tokens)
            if cursor.accept("}"):
                cursor.expect_end()
                self._expect_nothing_after(index)
                return graph
            self._statement(cursor)
        raise _error(self.last_line + 1, 1, f"expected '}}' closing graph @{graph.name}, got end of text")

    def _expect_nothing_after(self, index: int) -> None:
        if index + 1 < len(self.lines):
            raise _Cursor(self.lines[index + 1][1]).error("nothing after the closing '}' of the graph")

    def _header(self, cursor: _Cursor) -> Graph:
        cursor.expect("graph", " (the text starts with 'graph @name {')")
        symbol = cursor.expect_kind("symbol", "the graph name as '@name'")
        cursor.expect("{", " after the graph name")
        cursor.expect_end()
        try:
            self.graph = Graph(symbol.text[1:])
        except RlxError as exc:
            raise _error(symbol.line, symbol.column, str(exc)) from exc
        return self.graph

    def _statement(self, cursor: _Cursor) -> None:
        if cursor.at("output"):
            self._output(cursor)
        elif cursor.peek().kind == "value":
            self._definition(cursor)
        else:
            raise cursor.error("a statement ('%name = op ...' or 'output name = %value') or '}'")

    # ------------------------------------------------------------------ statements

    def _output(self, cursor: _Cursor) -> None:
        cursor.expect("output")
        while True:
            name = cursor.expect_kind("name", "an output name")
            cursor.expect("=", f" after output name {name.text!r}")
            value = self._use(cursor)
            self._build(name, functools.partial(_add_output, name=name.text, value=value))
            if not cursor.accept(","):
                break
        cursor.expect_end()

    def _definition(self, cursor: _Cursor) -> None:
        results = [cursor.next()]
        while cursor.accept(","):
            results.append(cursor.expect_kind("value", "a result name like %0"))
        for index, result in enumerate(results):
            self._check_new(result, results[:index])
        cursor.expect("=", " after the result names")
        op_token = cursor.expect_kind("name", "an op name")
        if op_token.text == OpKind.INPUT.value:
            values = self._input(cursor, op_token, results)
        else:
            values = self._op(cursor, self._op_kind(op_token), op_token, results)
        for result, value in zip(results, values, strict=True):
            self.values[result.text] = value
            self.defined_on[result.text] = result.line

    def _input(self, cursor: _Cursor, op_token: Token, results: list[Token]) -> tuple[Value, ...]:
        if len(results) != 1:
            raise _error(op_token.line, op_token.column, f"an input has one result, but the line names {len(results)}")
        name = cursor.expect_kind("string", 'the input name as a quoted string, like "q"')
        cursor.expect(":", " before the input's type")
        ty = self._type(cursor)
        cursor.expect_end()
        value = self._build(name, lambda g: g.input(name.string_value, ty.shape, ty.dtype))
        return (value,)

    def _op(self, cursor: _Cursor, op: OpKind, op_token: Token, results: list[Token]) -> tuple[Value, ...]:
        operands = []
        if cursor.peek().kind == "value":
            operands.append(self._use(cursor))
            while cursor.accept(","):
                operands.append(self._use(cursor))
        raw_attrs = self._attrs(cursor) if cursor.at("{") else {}
        attrs = self._make_attrs(op, op_token, raw_attrs)
        cursor.expect(":", " before the result types")
        annotated = [self._type(cursor)]
        while cursor.accept(","):
            annotated.append(self._type(cursor))
        cursor.expect_end()
        node = self._build(op_token, lambda g: g.add_node(op, operands, attrs))
        self._check_results(op_token, results, annotated, node.types)
        return node.outputs

    def _check_results(
        self, op_token: Token, results: list[Token], annotated: list[TensorType], inferred: tuple[TensorType, ...]
    ) -> None:
        where = f"{op_token.text} gives {len(inferred)} result(s) ({', '.join(map(str, inferred))})"
        if len(results) != len(inferred):
            raise _error(op_token.line, op_token.column, f"{where}, but the line names {len(results)}")
        if len(annotated) != len(inferred):
            raise _error(op_token.line, op_token.column, f"{where}, but the line annotates {len(annotated)} type(s)")
        for result, want, got in zip(results, annotated, inferred, strict=True):
            if want != got:
                raise _error(
                    result.line, result.column, f"{result.text} is annotated {want}, but {op_token.text} gives {got}"
                )

    # ------------------------------------------------------------------ pieces

    def _op_kind(self, token: Token) -> OpKind:
        try:
            return OpKind(token.text)
        except ValueError:
            known = ", ".join(op.value for op in OpKind)
            raise _error(token.line, token.column, f"unknown op {token.text!r}; expected one of {known}") from None

    def _attrs(self, cursor: _Cursor) -> dict[str, tuple[Token, list[Token]]]:
        """``{key = value, ...}`` as raw tokens; values are converted once the op is known."""
        cursor.expect("{")
        raw: dict[str, tuple[Token, list[Token]]] = {}
        while not cursor.at("}"):
            key = cursor.expect_kind("name", "an attribute name or '}'")
            if key.text in raw:
                raise _error(key.line, key.column, f"attribute {key.text!r} is given twice")
            cursor.expect("=", f" after attribute {key.text!r}")
            raw[key.text] = (key, self._attr_value(cursor, key))
            if not cursor.accept(","):
                break
        cursor.expect("}", " closing the attributes")
        return raw

    def _attr_value(self, cursor: _Cursor, key: Token) -> list[Token]:
        """Tokens up to the next ',' or '}' that is not inside brackets, e.g. ``sliding_window(3)``."""
        tokens: list[Token] = []
        closers: list[str] = []
        while not (not closers and (cursor.at(",") or cursor.at("}"))):
            token = cursor.peek()
            if token.kind == "end":
                raise cursor.error(f"the value of attribute {key.text!r} to end with ',' or '}}'")
            if token.kind == "punct" and token.text in _OPENERS:
                closers.append(_OPENERS[token.text])
            elif closers and token.kind == "punct" and token.text == closers[-1]:
                closers.pop()
            tokens.append(cursor.next())
        if not tokens:
            raise cursor.error(f"a value for attribute {key.text!r}")
        return tokens

    def _make_attrs(self, op: OpKind, op_token: Token, raw: dict[str, tuple[Token, list[Token]]]) -> object:
        """Fill the op's attrs dataclass by field name, converting by each field's annotated type."""
        cls = op.definition.attrs
        fields = {field.name: field for field in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        values: dict[str, object] = {}
        for name, (key, tokens) in raw.items():
            if name not in fields:
                expected = ", ".join(fields) or "no attributes"
                raise _error(key.line, key.column, f"{op} has no attribute {name!r}; expected {expected}")
            try:
                values[name] = _convert(hints[name], tokens)
            except (ValueError, TypeError) as exc:
                text = "".join(token.text for token in tokens)
                raise _error(
                    tokens[0].line,
                    tokens[0].column,
                    f"attribute {name!r} of {op} must be {_describe_type(hints[name])}, got {text!r} ({exc})",
                ) from exc
        missing = [name for name, field in fields.items() if name not in values and not _has_default(field)]
        if missing:
            raise _error(op_token.line, op_token.column, f"{op} needs attribute(s) {', '.join(missing)}")
        try:
            return cls(**values)
        except (ValueError, TypeError) as exc:
            raise _error(op_token.line, op_token.column, f"bad attributes for {op}: {exc}") from exc

    def _type(self, cursor: _Cursor) -> TensorType:
        dtype = cursor.expect_kind("name", f"a type like f32[2,4] (dtypes: {', '.join(DTYPE_NAMES)})")
        if dtype.text not in DTYPE_NAMES:
            raise cursor.error(f"a dtype ({', '.join(DTYPE_NAMES)})", dtype)
        cursor.expect("[", f" after dtype {dtype.text}")
        dims: list[int | str] = []
        while not cursor.at("]"):
            # A dimension: a positive int, a symbol (f32[2,Sk,4,64]) or a polynomial of them
            # (f32[2*Sk,64], f32[P+1,64], f32[S-1,64]). "-1" lexes as one number token.
            first = cursor.peek()
            if first.kind not in ("name", "number"):
                raise cursor.error("a dimension (a positive int or a symbol) or ']'")
            texts = []
            while not (cursor.at(",") or cursor.at("]") or cursor.at_kind("end")):
                texts.append(cursor.next().text)
            if len(texts) == 1 and first.kind == "number":
                if not first.text.isdigit() or int(first.text) < 1:
                    raise cursor.error("a dimension (a positive int)", first)
                dims.append(int(first.text))
            else:
                dim = parse_dim(" ".join(texts).replace("- ", "-"))
                if dim is None:
                    raise cursor.error("a dimension (a positive int, a symbol such as Sk, or 2*Sk, P+1, S-1)", first)
                dims.append(dim)
            if not cursor.accept(","):
                break
        cursor.expect("]", " closing the shape")
        return TensorType(tuple(dims), DTYPE_NAMES[dtype.text])

    def _use(self, cursor: _Cursor) -> Value:
        token = cursor.expect_kind("value", "a value like %q or %0")
        if token.text not in self.values:
            raise _error(token.line, token.column, f"unknown value {token.text} (not defined on an earlier line)")
        return self.values[token.text]

    def _check_new(self, token: Token, earlier_on_line: list[Token]) -> None:
        where = self.defined_on.get(token.text)
        if where is None and any(other.text == token.text for other in earlier_on_line):
            where = token.line
        if where is not None:
            raise _error(token.line, token.column, f"{token.text} is already defined on line {where}")

    def _build(self, token: Token, action: Callable[[Graph], typing.Any]) -> typing.Any:
        """Run a builder call; its errors become parse errors pointing at ``token``."""
        assert self.graph is not None
        try:
            return action(self.graph)
        except RlxError as exc:
            raise _error(token.line, token.column, str(exc)) from exc


def _has_default(field: dataclasses.Field[typing.Any]) -> bool:
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def parse(text: str) -> Graph:
    """Read textual IR into a new Graph; ``str(parse(str(g))) == str(g)`` for every graph built."""
    if not isinstance(text, str):
        raise RlxTypeError(f"parse: expected the IR text as a str, got {type(text).__name__}")
    return _Parser(text).parse()


def _add_output(graph: Graph, name: str, value: Value) -> None:
    graph.output(**{name: value})
