"""Docstrings as a test: a numpy ``Parameters`` section names the signature, no more, no less.

ruff's pydocstyle rules (numpy convention) check how a docstring is laid out; this checks what
its ``Parameters`` section says. Every function, method and class of ``fedps/``, ``crypto/``,
``clients/`` and ``server/`` whose docstring has that section is parsed, and:

- every documented name (``a, b`` entries split, ``name : type`` read as ``name``, ``*args`` and
  ``**kwargs`` as ``args`` and ``kwargs``) is a parameter of the signature: of the function, or
  for a class of its ``__init__`` or, without one, of its fields (a dataclass, a pydantic model);
- every parameter of the signature but ``self`` and ``cls`` is documented;
- no paragraph follows the entries (numpydoc would read its lines as entries): free text goes
  above the section.

Each drift is reported as ``path:line: name`` (the line of the ``def`` or ``class``). A
definition without the section is not checked: the section is where a parameter list can drift.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = ("fedps", "crypto", "clients", "server")
_IMPLICIT = ("self", "cls")

_Function = ast.FunctionDef | ast.AsyncFunctionDef
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _is_rule(line: str) -> bool:
    return bool(line.strip()) and set(line.strip()) == {"-"}


def _section(docstring: str, title: str) -> list[str] | None:
    """The lines of section ``title`` of a cleaned numpy docstring, None without one."""
    lines = docstring.splitlines()
    for start in range(len(lines) - 1):
        if lines[start].strip() == title and _is_rule(lines[start + 1]):
            body: list[str] = []
            for index in range(start + 2, len(lines)):
                line = lines[index]
                header = not line[:1].isspace() and index + 1 < len(lines)
                if header and line.strip() and _is_rule(lines[index + 1]):
                    break  # the next section
                body.append(line)
            return body
    return None


def _documented(docstring: str) -> list[str] | None:
    """The names the ``Parameters`` section documents, in order; None without the section.

    A line at the entries' indentation that is not a list of names (prose that follows the
    section) is kept whole, so that it is reported once.
    """
    body = _section(docstring, "Parameters")
    if body is None:
        return None
    names: list[str] = []
    for line in body:
        if line.strip() and not line[:1].isspace():  # an entry; its description is indented
            entry = line.split(" : ")[0]  # ``name : type``
            split = [name.strip().replace("\\", "").lstrip("*") for name in entry.split(",")]
            names += split if all(name.isidentifier() for name in split) else [line.strip()]
    return names


def _parameters(function: _Function) -> list[str]:
    arguments = function.args
    named = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    starred = [arg for arg in (arguments.vararg, arguments.kwarg) if arg is not None]
    return [arg.arg for arg in (*named, *starred) if arg.arg not in _IMPLICIT]


def _named(node: ast.expr, *names: str) -> bool:
    """Whether ``node`` is ``NAME`` or ``module.NAME`` for one of ``names``."""
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr in names


def _is_field(statement: ast.AnnAssign) -> bool:
    """Whether an annotated class attribute is a constructor parameter.

    It is not when it is a ``ClassVar``, ``field(init=False)`` or a pydantic private attribute.
    """
    annotation = statement.annotation
    if isinstance(annotation, ast.Subscript):
        annotation = annotation.value
    if _named(annotation, "ClassVar", "KW_ONLY") or not isinstance(statement.target, ast.Name):
        return False
    value = statement.value
    if isinstance(value, ast.Call):
        if _named(value.func, "PrivateAttr"):
            return False
        for keyword in value.keywords:
            if keyword.arg == "init" and isinstance(keyword.value, ast.Constant):
                return bool(keyword.value.value)
    return True


def _class_parameters(cls: ast.ClassDef) -> list[str]:
    """The parameters of ``cls``'s ``__init__``, or without one its fields."""
    for statement in cls.body:
        if isinstance(statement, _FUNCTIONS) and statement.name == "__init__":
            return _parameters(statement)
    return [
        statement.target.id
        for statement in cls.body
        if isinstance(statement, ast.AnnAssign)
        and isinstance(statement.target, ast.Name)
        and _is_field(statement)
    ]


def _drifts(source: str, where: str) -> Iterator[str]:
    """``where:line: name`` for each name documented but not a parameter, or the reverse."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
            continue
        docstring = ast.get_docstring(node)
        documented = None if docstring is None else _documented(docstring)
        if documented is None:
            continue
        if isinstance(node, ast.ClassDef):
            parameters = _class_parameters(node)
        else:
            parameters = _parameters(node)
        for name in documented:
            if not name.isidentifier():
                yield f"{where}:{node.lineno}: {name} (prose, not an entry: move it above)"
            elif name not in parameters:
                yield f"{where}:{node.lineno}: {name} (documented, not a parameter)"
        for name in parameters:
            if name not in documented:
                yield f"{where}:{node.lineno}: {name} (a parameter, not documented)"


def _product_drifts() -> Iterator[str]:
    for package in _PACKAGES:
        for path in sorted((_ROOT / package).rglob("*.py")):
            yield from _drifts(path.read_text(), path.relative_to(_ROOT).as_posix())


def test_documented_parameters_match_the_signatures() -> None:
    # Execute
    drifts = list(_product_drifts())

    # Assert
    assert not drifts, "Parameters sections that drifted from their signature:\n" + "\n".join(
        drifts
    )


def test_a_documented_name_the_signature_lacks_is_a_drift() -> None:
    # Prepare
    source = '''
def push(block: int, *, retry_s: float) -> None:
    """Push a block.

    Parameters
    ----------
    block
        Which block.
    retry_s
        How long to retry.
    timeout_s
        A parameter that was renamed since.
    """
'''

    # Execute
    drifts = list(_drifts(source, "probe.py"))

    # Assert
    assert drifts == ["probe.py:2: timeout_s (documented, not a parameter)"]


def test_an_undocumented_parameter_is_a_drift() -> None:
    # Prepare
    source = '''
class Pusher:
    def send(self, messages: list[bytes], shard: str) -> int:
        """Send messages.

        Parameters
        ----------
        messages
            What to send.
        """
        return 0
'''

    # Execute
    drifts = list(_drifts(source, "probe.py"))

    # Assert
    assert drifts == ["probe.py:3: shard (a parameter, not documented)"]


def test_grouped_typed_and_starred_entries_match() -> None:
    # Prepare: ``a, b`` entries, ``name : type``, ``*args`` and ``**kwargs`` (escaped or not)
    source = '''
def call(round_: int, version: int, /, flag: bool, *args: int, **kwargs: str) -> None:
    """Call.

    Parameters
    ----------
    round_, version
        The round and its model version.
    flag : bool
        A flag.
    \\\\*args
        Positional extras.
    **kwargs
        Keyword extras.

    Returns
    -------
    None
        Nothing (``Returns`` entries are not parameters).
    """
'''

    # Execute
    drifts = list(_drifts(source, "probe.py"))

    # Assert
    assert drifts == []


def test_a_class_is_checked_against_its_init_or_its_fields() -> None:
    # Prepare: one class with ``__init__``, one dataclass, one pydantic model
    source = '''
class Ring:
    """A ring.

    Parameters
    ----------
    nodes
        The nodes.
    """

    def __init__(self, nodes: list[str], replicas: int) -> None:
        pass


@dataclass
class Spend:
    """A spend.

    Parameters
    ----------
    epsilon
        Spent.
    """

    epsilon: float
    unit: ClassVar[str] = "nats"
    cache: dict[str, float] = field(init=False)


class Settings(BaseModel):
    """Settings.

    Parameters
    ----------
    port
        The port.
    host
        A field that is not there.
    """

    port: int
    _lock: object = PrivateAttr()
'''

    # Execute
    drifts = list(_drifts(source, "probe.py"))

    # Assert
    assert drifts == [
        "probe.py:2: replicas (a parameter, not documented)",
        "probe.py:30: host (documented, not a parameter)",
    ]


def test_prose_after_the_entries_is_a_drift() -> None:
    # Prepare: a paragraph that follows the section is read as entries, as numpydoc reads it
    source = '''
def pull(version: int) -> None:
    """Pull a version.

    Parameters
    ----------
    version
        The version.

    Each block is verified.
    """
'''

    # Execute
    drifts = list(_drifts(source, "probe.py"))

    # Assert
    assert drifts == ["probe.py:2: Each block is verified. (prose, not an entry: move it above)"]


def test_a_docstring_without_a_parameters_section_is_not_checked() -> None:
    # Prepare
    source = '''
def add(a: int, b: int) -> int:
    """Add ``a`` and ``b``.

    Returns
    -------
    int
        The sum.
    """
    return a + b
'''

    # Execute
    drifts = list(_drifts(source, "probe.py"))

    # Assert
    assert drifts == []
