"""YAML in and out, the way Kubernetes tools print it: keys in the order built, no anchors."""

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


def load_all(text: str) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]
