"""Fault injection for tests and alert rehearsals: NaN in a layer's output, a corrupted weight block, a
batch-size-dependent fault. Never active unless ``serve --enable-fault-injection`` (docs/troubleshooting.md).

A spec is a comma-separated list of ``key=value`` pairs, for example
``nan_layer=1,nan_p=0.2`` or ``batch_min_seqs=3`` or ``corrupt_weight=model.layers.0.mlp.down_proj.weight``:

- ``nan_layer=L,nan_p=P``: after decoder layer ``L``, each sequence of a step gets NaN in its rows with
  probability ``P``. The draw is a hash of (``seed``, request id, position), so a recompute of the same
  sequence at the same position decides the same way and a test can name the affected requests
  (``FaultInjector.poisoned``). ``nan_fp8_only=1`` fires only while that layer's FP8 linears compute in
  reduced precision (an activation outlier the float32 fallback avoids).
- ``batch_min_seqs=N[,batch_layer=L]``: when a step holds at least ``N`` sequences, layer ``L``'s output
  gets finite noise of its own magnitude (the shape of the public "wrong once 3+ sequences share a batch"
  reports: finite, so only the self-test's batch-invariance check can see it).
- ``corrupt_weight=NAME``: the first 128x128 block of parameter ``NAME`` is overwritten with noise of ten
  times the tensor's spread, once (after the weights fingerprint).
- ``onset_s=S``: every fault above stays dormant for ``S`` seconds after installation, then engages (a pod
  that starts healthy and breaks while serving).
- ``on_host=NAME``: the fault is installed only in the process whose hostname (``socket.gethostname()``;
  in a Kubernetes pod, the pod's name) is ``NAME``, compared case-insensitively; elsewhere ``serve`` runs
  without it. A StatefulSet gives every pod the same arguments, so this is how a test breaks one pod of a
  pool (``on_host=tiny-unified-1``) and leaves the others healthy.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .fp8 import Fp8Linear

_BLOCK = 128
# An RFC 1123 host name (labels of letters, digits and inner hyphens, dot-separated), as gethostname gives.
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*")


@dataclass(frozen=True)
class FaultSpec:
    nan_layer: int | None = None
    nan_p: float = 0.0
    nan_fp8_only: bool = False
    batch_min_seqs: int | None = None
    batch_layer: int = 0
    corrupt_weight: str | None = None
    seed: int = 0
    onset_s: float = 0.0
    on_host: str | None = None

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``key=value,...``; raises ValueError naming the key and what is valid."""
        fields: dict[str, Any] = {}
        ints = {"nan_layer", "batch_min_seqs", "batch_layer", "seed"}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or not value.strip():
                raise ValueError(f"fault spec item {part!r} must be key=value")
            value = value.strip()
            try:
                if key in ints:
                    fields[key] = int(value)
                elif key in ("nan_p", "onset_s"):
                    fields[key] = float(value)
                elif key == "nan_fp8_only":
                    if value not in ("0", "1", "true", "false"):
                        raise ValueError
                    fields[key] = value in ("1", "true")
                elif key in ("corrupt_weight", "on_host"):
                    fields[key] = value
                else:
                    raise KeyError(key)
            except KeyError:
                valid = (
                    "nan_layer, nan_p, nan_fp8_only, batch_min_seqs, batch_layer, corrupt_weight, onset_s,"
                    " on_host, seed"
                )
                raise ValueError(f"unknown fault spec key {key!r}; valid keys: {valid}") from None
            except ValueError:
                raise ValueError(f"fault spec {key}={value!r} is not a valid value") from None
        spec = cls(**fields)
        spec.validate()
        return spec

    def validate(self) -> None:
        if not 0.0 <= self.nan_p <= 1.0:
            raise ValueError(f"fault spec nan_p must be in [0, 1], got {self.nan_p}")
        if (self.nan_layer is None) != (self.nan_p == 0.0):
            raise ValueError("fault spec nan_layer and nan_p go together (nan_p > 0 needs nan_layer)")
        if not 0.0 <= self.onset_s <= 86400.0:
            raise ValueError(f"fault spec onset_s must be in [0, 86400] seconds, got {self.onset_s}")
        if self.on_host is not None and (len(self.on_host) > 253 or not _HOSTNAME.fullmatch(self.on_host)):
            raise ValueError(
                f"fault spec on_host must be a host name (letters, digits, inner '-' and '.'), got {self.on_host!r}"
            )
        if self.batch_min_seqs is not None and self.batch_min_seqs < 1:
            raise ValueError(f"fault spec batch_min_seqs must be at least 1, got {self.batch_min_seqs}")
        if not (self.nan_layer is not None or self.batch_min_seqs is not None or self.corrupt_weight):
            raise ValueError(
                "fault spec injects nothing: set nan_layer+nan_p, batch_min_seqs or corrupt_weight"
            )

    def engages_on(self, hostname: str) -> bool:
        """Whether this spec's faults belong in a process on ``hostname`` (always, without ``on_host``)."""
        return self.on_host is None or self.on_host.lower() == hostname.lower()


class FaultInjector:
    """Installs one ``FaultSpec`` on a model; the model runner calls ``begin_step`` before each forward."""

    def __init__(self, model: nn.Module, spec: FaultSpec) -> None:
        self.spec = spec
        self.model = model
        layers = _decoder_layers(model)
        self.poisoned: set[str] = set()  # request ids that got NaN at least once
        self.batch_faults = 0  # steps the batch-size fault fired in
        self._nan_rows: list[int] = []
        self._num_seqs = 0
        self._hooks = []
        for layer_idx, hook in ((spec.nan_layer, self._nan_hook), (spec.batch_layer, self._batch_hook)):
            if layer_idx is None or (hook == self._batch_hook and spec.batch_min_seqs is None):
                continue
            if not 0 <= layer_idx < len(layers):
                raise ValueError(f"fault spec layer {layer_idx} is not in [0, {len(layers)})")
            self._hooks.append(layers[layer_idx].register_forward_hook(hook))
        if spec.nan_layer is not None:
            self._fp8 = [m for m in layers[spec.nan_layer].modules() if isinstance(m, Fp8Linear)]
        self._noise = torch.Generator().manual_seed(spec.seed)
        self._onset = time.monotonic() + spec.onset_s
        self._engaged = False
        if spec.corrupt_weight:
            _find_parameter(model, spec.corrupt_weight)  # a wrong name fails now, not at the onset
        self._engage()

    def _engage(self) -> bool:
        """True once the onset has passed; corrupts the weight block the first time."""
        if not self._engaged and time.monotonic() >= self._onset:
            self._engaged = True
            if self.spec.corrupt_weight:
                corrupt_weight_block(self.model, self.spec.corrupt_weight, self.spec.seed)
        return self._engaged

    def begin_step(self, request_ids: Sequence[str], positions: Sequence[int], counts: Sequence[int]) -> None:
        """The next forward's sequences (request id, first new position, new tokens), in batch order."""
        self._num_seqs = 0
        self._nan_rows = []
        if not self._engage():
            return
        self._num_seqs = len(request_ids)
        p = self.spec.nan_p
        if p <= 0.0:
            return
        start = 0
        for rid, pos, n in zip(request_ids, positions, counts, strict=True):
            key = f"{self.spec.seed}:{rid}:{pos}".encode()
            draw = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64
            if draw < p:
                self._nan_rows.extend(range(start, start + n))
                self.poisoned.add(rid)
            start += n

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _nan_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not self._nan_rows:
            return None
        if self.spec.nan_fp8_only and any(m.compute_dtype is not None for m in self._fp8):
            return None  # the reduced-precision path is off for this forward: the outlier does not occur
        rows = torch.tensor(self._nan_rows, device=output.device)
        return output.index_fill(0, rows, float("nan"))

    def _batch_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        assert self.spec.batch_min_seqs is not None
        if self._num_seqs < self.spec.batch_min_seqs:
            return None
        self.batch_faults += 1
        noise = torch.randn(output.shape, generator=self._noise).to(output.device, output.dtype)
        return output + noise * output.float().pow(2).mean().sqrt().to(output.dtype)


def corrupt_weight_block(model: nn.Module, name: str, seed: int = 0) -> None:
    """Overwrite the first 128x128 block of parameter ``name`` with noise (ten times its spread)."""
    p = _find_parameter(model, name)
    with torch.no_grad():
        block = p.data[:_BLOCK, :_BLOCK] if p.dim() >= 2 else p.data[:_BLOCK]
        spread = float(block.float().std()) or 1.0
        g = torch.Generator().manual_seed(seed + 1)
        noise = torch.randn(block.shape, generator=g) * 10 * spread
        block.copy_(noise.to(p.device, p.dtype))
    from .layers import forget_derived_weights

    forget_derived_weights(model)


def _find_parameter(model: nn.Module, name: str) -> nn.Parameter:
    params = dict(model.named_parameters())
    if name not in params:
        hint = ", ".join(n for n in list(params)[:5])
        raise ValueError(f"fault spec corrupt_weight: no parameter {name!r} (names look like {hint}, ...)")
    return params[name]


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("fault injection needs a DeepSeek-V3 model (model.layers)")
    return layers
