"""Model downloads from a Hugging Face hub (or a mirror) into a cache directory.

`sovereign-runtime download` is what the operator's download Job runs: resolve a revision to its
commit, list the files the allow/ignore patterns select, download them with byte-range resume,
verify sizes and safetensors headers, and write a completion marker. The cache layout, shared
with the pools that read it:

    <dest>/checkpoint/...         the repo's files (what `serve --model` reads)
    <dest>/.partial/<path>.part   bytes of a file still downloading (resumed by range)
    <dest>/complete.json          written last, after verification: the commit and the file list
"""

from .failures import DownloadFailure, classify
from .listing import RepoEntry, Resolution, resolve

__all__ = ["DownloadFailure", "RepoEntry", "Resolution", "classify", "resolve"]
