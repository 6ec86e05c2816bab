"""YAML in and out, the way Kubernetes tools print it: keys in the order built, no anchors.

Reading is bounded: a document that would expand to far more than its text (an alias bomb, "billion
laughs") or nest deeper than any manifest does is refused while it is parsed, before anything walks it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml


class _PlainDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_presenter(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Multi-line strings (the preStop script) print as literal blocks so they stay readable.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_PlainDumper.add_representer(str, _str_presenter)


def dump(document: Any) -> str:
    return yaml.dump(document, Dumper=_PlainDumper, sort_keys=False, width=100)


def dump_all(documents: Iterable[Any]) -> str:
    return yaml.dump_all(list(documents), Dumper=_PlainDumper, sort_keys=False, width=100)


# A document's nodes once aliases are expanded (an LLMDeployment has a few hundred), and its nesting.
MAX_EXPANDED_NODES = 100_000
MAX_DEPTH = 64


def _expanded_size(root: yaml.Node, budget: int) -> int:
    """Nodes of the document with every alias expanded, counted without expanding (memoised over the
    node graph); stops past `budget`. Raises yaml.YAMLError for an alias inside its own anchor."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            size = 1 + sum(sizes[id(child)] for child in _children(node))
            sizes[key] = min(size, budget + 1)
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise yaml.YAMLError(f"an alias refers to its own anchor, line {node.start_mark.line + 1}")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses deep nesting while composing and alias bombs before constructing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(f"nested more than {MAX_DEPTH} levels deep, line {mark.line + 1}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        if node is not None and _expanded_size(node, MAX_EXPANDED_NODES) > MAX_EXPANDED_NODES:
            raise yaml.YAMLError(
                f"aliases (*name) expand the document beyond {MAX_EXPANDED_NODES} nodes, line "
                f"{node.start_mark.line + 1}"
            )
        return node


def load_all(text: str) -> list[Any]:
    """Every non-empty document; raises yaml.YAMLError (one line) past the depth or expansion budget."""
    loader = _BoundedLoader(text)
    try:
        documents = []
        while loader.check_data():
            document = loader.get_data()
            if document is not None:
                documents.append(document)
        return documents
    finally:
        loader.dispose()
