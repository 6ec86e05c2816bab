"""Pipeline parallelism for the model: which stage holds which layers and weights, and one stage's forward.

Layers split evenly over the stages, the remainder going to the earlier ones (the last stage also carries
the MTP layer, so it gets the smaller share). Weights by stage:

- stage 0 (the leader's) holds the embedding, its decoder layers, and the heads the leader computes logits
  with: ``lm_head`` and each MTP layer's ``shared_head`` (so logits and draft logits never cross the
  network, only hidden states do);
- the last stage holds its decoder layers, the final norm, and the MTP layers' bodies (``enorm``, ``hnorm``,
  ``eh_proj`` and the decoder layer) with their own copy of the embedding, which the MTP layer reads;
- a middle stage holds its decoder layers only.

A stage's model is the whole ``DeepseekV3ForCausalLM`` built on the meta device with the modules other stages
hold taken out (``strip_to_stage``), so checkpoint names keep matching module names and the loader reads
only this stage's tensors. Each stage keeps the KV pages of its own attention layers (its decoder layers,
and on the last stage the MTP layers); the block tables are the leader's and the same for every stage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn

from .config import ModelConfig
from .context import AttentionMetadata, get_attention_metadata

_DECODER_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP = re.compile(r"^mtp\.(\d+)\.")


def split_layers(num_layers: int, stages: int) -> list[range]:
    """Contiguous decoder-layer ranges per stage, as even as possible, earlier stages taking the remainder."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} pipeline stages for {num_layers} decoder layers: need 1..{num_layers}")
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


def pipeline_parallel_problem(config: ModelConfig, size: int) -> str | None:
    """Why ``size`` stages cannot split this model, or None."""
    if size > config.num_hidden_layers:
        return (
            f"--pipeline-parallel-size {size}: the model has {config.num_hidden_layers} decoder layers,"
            f" at most that many stages"
        )
    return None


@dataclass(frozen=True)
class PipelineStage:
    """This process's stage: ``index`` of ``count``, holding decoder layers ``layers``."""

    index: int = 0
    count: int = 1
    layers: range = range(0)

    @classmethod
    def of(cls, config: ModelConfig, index: int, count: int) -> PipelineStage:
        return cls(index, count, split_layers(config.num_hidden_layers, count)[index])

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def owner_of_layer(self, config: ModelConfig, layer: int) -> int:
        """The stage holding cache layer ``layer`` (decoder layers, then the MTP layers on the last stage)."""
        if layer >= config.num_hidden_layers:
            return self.count - 1
        for stage, held in enumerate(split_layers(config.num_hidden_layers, self.count)):
            if layer in held:
                return stage
        raise ValueError(f"layer {layer} is outside the model's {config.num_hidden_layers} decoder layers")

    def holds(self, name: str, config: ModelConfig) -> bool:
        """Whether parameter ``name`` (a ``DeepseekV3ForCausalLM`` name) lives on this stage."""
        if self.count == 1:
            return True
        layer = _DECODER_LAYER.match(name)
        if layer:
            return int(layer.group(1)) in self.layers
        if name.startswith("model.embed_tokens."):
            # The last stage's MTP layers embed the tokens that follow (their own copy).
            return self.is_first or (self.is_last and config.num_nextn_predict_layers > 0)
        if name.startswith("model.norm."):
            return self.is_last
        if name.startswith("lm_head."):
            return self.is_first
        if _MTP.match(name):
            return self.is_first if ".shared_head." in name else self.is_last
        return True  # nothing else exists today; a new top-level weight stays everywhere

    def kv_layers(self, config: ModelConfig, cache_layers: int) -> int:
        """How many of the engine's ``cache_layers`` (decoder layers, then MTP layers) this stage keeps."""
        mtp = max(0, cache_layers - config.num_hidden_layers)
        if self.count == 1:
            return cache_layers
        return len(self.layers) + (mtp if self.is_last else 0)


def stage_layer_counts(config: ModelConfig, count: int, cache_layers: int) -> list[int]:
    """KV-cache layers per stage for an engine cache of ``cache_layers`` layers."""
    return [PipelineStage.of(config, s, count).kv_layers(config, cache_layers) for s in range(count)]


class _Elsewhere(nn.Module):
    """Where a module another stage holds would be: no weights, and an error if run."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError(f"{self.what} is held by another pipeline stage")


def strip_to_stage(model: nn.Module, stage: PipelineStage) -> None:
    """Take the modules other stages hold out of a (meta) ``DeepseekV3ForCausalLM``, in place."""
    if stage.count == 1:
        return
    config = model.config
    layers = model.model.layers
    for i in range(len(layers)):
        if i not in stage.layers:
            layers[i] = _Elsewhere(f"decoder layer {i}")
    if not stage.holds("model.embed_tokens.weight", config):
        model.model.embed_tokens = _Elsewhere("the embedding")
    if not stage.is_last:
        model.model.norm = _Elsewhere("the final norm")
    if not stage.is_first:
        model.lm_head = _Elsewhere("the LM head")
    for mtp in model.mtp:
        for name, _child in list(mtp.named_children()):
            if stage.holds(f"mtp.0.{name}.", config):
                continue
            setattr(mtp, name, _Elsewhere(f"the MTP layer's {name}"))


def stage_attention_layers(model: nn.Module, stage: PipelineStage, cache_layers: int) -> list[nn.Module]:
    """This stage's attention modules in its cache-layer order: its decoder layers, then (last stage, when
    the cache has them) the MTP layers."""
    config = model.config
    held = [model.model.layers[i].self_attn for i in stage.layers]
    if stage.is_last or stage.count == 1:
        mtp = cache_layers - config.num_hidden_layers
        held += [m.self_attn for m in list(model.mtp)[: max(0, mtp)]]
    return held


def bind_stage_kv_cache(
    model: nn.Module, stage: PipelineStage, cache: torch.Tensor, cache_layers: int
) -> None:
    """Bind ``cache [layers, blocks, block_size, kv_dim]``, this stage's share of an engine cache of
    ``cache_layers`` layers, to its attention modules."""
    if stage.count == 1:
        model.bind_kv_cache(cache)
        return
    config = model.config
    layers = stage_attention_layers(model, stage, cache_layers)
    if cache.dim() != 4 or cache.shape[0] != len(layers) or cache.shape[-1] != config.kv_cache_dim:
        raise ValueError(
            f"stage {stage.index} KV cache must be [{len(layers)}, blocks, block_size, {config.kv_cache_dim}],"
            f" got {tuple(cache.shape)}"
        )
    for i, attn in enumerate(layers):
        attn.kv_cache = cache[i]


@torch.no_grad()
def run_stage(
    model: nn.Module, stage: PipelineStage, input_ids: torch.Tensor, hidden: torch.Tensor | None
) -> torch.Tensor:
    """This stage's part of a forward under the installed attention context: the embedding (first stage,
    else ``hidden`` from the stage before), its decoder layers, and the final norm on the last stage."""
    positions = get_attention_metadata().positions
    x = model.model.embed_tokens(input_ids) if stage.is_first else hidden
    assert x is not None, "a later stage needs the hidden states of the stage before"
    for i in stage.layers:
        x = model.model.layers[i](x, positions)
    return model.model.norm(x) if stage.is_last else x


@dataclass(frozen=True)
class MicroBatch:
    """A contiguous run of a step's sequences: their new tokens and their own attention metadata."""

    tokens: slice
    meta: AttentionMetadata


def split_micro_batches(meta: AttentionMetadata, parts: int) -> list[MicroBatch]:
    """Cut a step into at most ``parts`` micro-batches of whole sequences with about as many new tokens
    each, in order (a later micro-batch may read KV an earlier one wrote, never the other way round)."""
    starts = meta.query_start_loc.tolist()
    num_seqs, total = len(starts) - 1, starts[-1]
    parts = max(1, min(parts, num_seqs))
    cuts = [0]
    for k in range(1, parts):
        target = total * k / parts
        # The sequence boundary nearest the k-th share (ties: the later one), leaving at least one
        # sequence for each part after it.
        allowed = range(cuts[-1] + 1, num_seqs - (parts - k) + 1)
        cuts.append(min(allowed, key=lambda i: (abs(starts[i] - target), starts[i] < target)))
    cuts.append(num_seqs)
    context = meta.context_lens.tolist()
    batches = []
    for a, b in pairwise(cuts):
        first, last = starts[a], starts[b]
        lengths = [starts[i + 1] - starts[i] for i in range(a, b)]
        batches.append(
            MicroBatch(
                slice(first, last),
                AttentionMetadata(
                    positions=meta.positions[first:last],
                    slot_mapping=meta.slot_mapping[first:last],
                    query_start_loc=meta.query_start_loc[a : b + 1] - first,
                    context_lens=meta.context_lens[a:b],
                    block_tables=meta.block_tables[a:b],
                    max_query_len=max(lengths),
                    max_context_len=max(context[a:b]),
                    block_size=meta.block_size,
                ),
            )
        )
    return batches
