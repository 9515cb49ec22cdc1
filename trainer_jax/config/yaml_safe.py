"""The one YAML loader for everything a user hands the trainer: configs, ``key=value`` overrides,
``--plan``, ``--limits``, ``--prices`` and sweep files.

``yaml.safe_load`` builds no objects but trusts the document's size: 700 bytes of nested aliases
(a "billion laughs") stand for 10^9 values, cheap to load as shared references and then walked
whole by validation or by ``repr`` in an error message (the process hangs); 20,000 nested
brackets recurse once per level and end in a ``RecursionError`` traceback. Here a document is
composed into its node graph first (PyYAML's pure-Python composer, depth-limited), the graph is
walked without recursion to count what its aliases expand to, duplicate keys and recursive
aliases are refused, and only then are Python objects built. Files are read with a bound and only
when they are regular files (a FIFO would block, ``/dev/zero`` never ends).

Every refusal is a ``YamlError`` whose message is one line that starts with ``what`` (the flag or
file) and names the limit.
"""

from __future__ import annotations

import os
import reprlib
import stat
from pathlib import Path
from typing import Any

import yaml

#: Bytes of one YAML file (a config is a few KiB; the largest shipped one is under 10 KiB).
MAX_YAML_BYTES = 1 << 20
#: Bytes of one ``key=value`` override (the kernel caps one argument at 128 KiB anyway).
MAX_OVERRIDE_BYTES = 64 << 10
#: Nesting depth of a document (a config nests about 6 deep).
MAX_DEPTH = 100
#: Nodes that aliases may add to a document over its own nodes (what ``*ref`` expands to).
MAX_ALIAS_EXPANSION = 100_000


class YamlError(ValueError):
    """A YAML document that is unreadable, malformed or over a limit; the message is one line."""


def short(value: Any, limit: int = 100) -> str:
    """``repr(value)`` cut to about ``limit`` characters without building the whole repr (a value
    that aliases expand or a 1 MB string costs no more than its first few elements)."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = limit
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 8
    r.maxlevel = 4
    text = r.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _Loader(yaml.SafeLoader):
    """SafeLoader whose scanner (brackets) and composer (any nesting) stop at ``MAX_DEPTH``
    levels, long before Python's recursion limit."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def fetch_flow_collection_start(self, TokenClass):  # noqa: ANN001, ANN201, N803  (PyYAML's)
        # The scanner looks ahead up to 1,024 characters per open bracket for a possible key (a
        # quadratic walk, seconds for a line of brackets): refuse at the bracket that is too deep.
        if self.flow_level >= MAX_DEPTH:
            mark = self.get_mark()
            raise YamlError(f"nested deeper than {MAX_DEPTH} levels (line {mark.line + 1}, column "
                            f"{mark.column + 1}; the limit of nesting for a YAML document)")
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent, index):  # noqa: ANN001, ANN201  (PyYAML's signature)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlError(f"nested deeper than {MAX_DEPTH} levels (line {mark.line + 1}, column "
                                f"{mark.column + 1}; the limit of nesting for a YAML document)")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_graph(root: yaml.Node) -> None:
    """Refuse duplicate keys, recursive aliases and an expansion over ``MAX_ALIAS_EXPANSION``.

    Aliases share nodes, so the graph is a DAG: each node's expanded size is computed once
    (iterative post-order), and the expansion is the root's expanded size minus the distinct
    nodes. A node met again while its own children are being walked is a recursive alias.
    """
    size: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, closing = stack.pop()
        key = id(node)
        if closing:
            open_.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in _children(node))
            continue
        if key in size:
            continue
        if key in open_:
            mark = node.start_mark
            raise YamlError(f"a recursive alias (line {mark.line + 1}): a document must be a tree")
        open_.add(key)
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            for k, _ in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value != "<<":  # merge keys may repeat
                    ident = (k.tag, k.value)
                    if ident in seen:
                        raise YamlError(f"duplicate key {short(k.value, 60)} (lines {seen[ident] + 1} "
                                        f"and {k.start_mark.line + 1}): the first would be ignored")
                    seen[ident] = k.start_mark.line
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
    expansion = size[id(root)] - len(size)
    if expansion > MAX_ALIAS_EXPANSION:
        raise YamlError(f"its aliases expand to {expansion:,} more values than it writes, over the limit "
                        f"of {MAX_ALIAS_EXPANSION:,} alias expansions (an alias bomb?)")


def load_yaml(text: str, what: str) -> Any:
    """The document in ``text`` as Python values (None for an empty one); ``what`` names it in a
    ``YamlError`` (``"config c.yaml"``, ``"--plan p.yaml"``, ``"override 'a.b=...'"``)."""
    loader = None
    try:
        loader = _Loader(text)  # the reader refuses a NUL or other control character here
        root = loader.get_single_node()
        if root is None:
            return None
        _check_graph(root)
        return loader.construct_document(root)
    except YamlError as e:
        raise YamlError(f"{what}: {e}") from None
    except yaml.YAMLError as e:  # a parse error, an unknown tag (!!python/object), a NUL byte
        raise YamlError(f"{what}: not valid YAML ({' '.join(str(e).split())[:300]})") from None
    except RecursionError:  # not reached below MAX_DEPTH; kept so no traceback can escape
        raise YamlError(f"{what}: nested too deep for the YAML loader") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_text(path: str | os.PathLike, what: str, max_bytes: int = MAX_YAML_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``max_bytes`` of it read (a bigger
    file is refused), or a ``YamlError`` naming ``what``: missing, not a regular file (a FIFO is
    never opened for reading, so it cannot block), unreadable, too big, not UTF-8."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise YamlError(f"{what}: cannot be read, {p.name} does not exist") from None
    except OSError as e:
        raise YamlError(f"{what}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a file")
        raise YamlError(f"{what}: not a regular file ({kind})")
    if st.st_size > max_bytes:
        raise YamlError(f"{what}: {st.st_size:,} bytes, over the limit of {max_bytes:,} bytes "
                        "for a YAML file")
    try:
        # O_NONBLOCK: had the file been swapped for a FIFO since the stat, opening it does not block.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise YamlError(f"{what}: not a regular file")
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise YamlError(f"{what}: cannot be read ({e.strerror})") from None
    if len(data) > max_bytes:  # it grew since the stat
        raise YamlError(f"{what}: over the limit of {max_bytes:,} bytes for a YAML file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise YamlError(f"{what}: not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") \
            from None


def read_yaml(path: str | os.PathLike, what: str, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """``load_yaml`` of the file ``path`` read with ``read_text``'s bounds."""
    return load_yaml(read_text(path, what, max_bytes), what)


__all__ = ["MAX_ALIAS_EXPANSION", "MAX_DEPTH", "MAX_OVERRIDE_BYTES", "MAX_YAML_BYTES", "YamlError",
           "load_yaml", "read_text", "read_yaml", "short"]
