"""Load an HF-format DeepSeek-V3 checkpoint (safetensors, real tensor names, optional FP8 block scales)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .config import ModelConfig
from .deepseek_v3 import DeepseekV3ForCausalLM
from .fp8 import dequantize_fp8_block, swap_in_fp8_linears
from .parallel import TensorParallel, shard, shard_dim
from .pipeline import PipelineStage, strip_to_stage

log = logging.getLogger("sovereign_runtime.model")

# Tensors that stay fp32 whatever the model dtype (the router decides in fp32, as in the reference).
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


@contextmanager
def open_checkpoint(path: str | Path) -> Iterator[dict[str, Callable[[], torch.Tensor]]]:
    """Name → loader for every tensor of the checkpoint; tensors are read only when loaded."""
    with ExitStack() as stack:
        loaders: dict[str, Callable[[], torch.Tensor]] = {}
        for file in _checkpoint_files(Path(path)):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                loaders[name] = lambda h=handle, n=name: h.get_tensor(n)
        yield loaders


def _module_name(name: str, config: ModelConfig) -> str | None:
    """Checkpoint name → parameter name in ``DeepseekV3ForCausalLM``; None for tensors we do not keep."""
    n = config.num_hidden_layers
    if name.startswith("model.layers."):
        idx_str, _, rest = name[len("model.layers.") :].partition(".")
        idx = int(idx_str)
        if idx >= n:
            depth = idx - n
            if depth >= config.num_nextn_predict_layers:
                return None
            if rest.startswith("embed_tokens."):
                return None  # the MTP module shares the main embedding
            return f"mtp.{depth}.{rest}"
    if "rotary_emb" in name:
        return None
    return name


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    keep_fp8: bool | None = None,
    tensor_parallel: TensorParallel | None = None,
    pipeline: PipelineStage | None = None,
) -> tuple[DeepseekV3ForCausalLM, ModelConfig]:
    """Build the model from ``path`` (config.json + safetensors) on ``device``.

    ``dtype`` defaults to the checkpoint's dtype on CPU and bf16 on GPU. FP8 block-quantised weights are
    dequantised to ``dtype`` at load time, or with ``keep_fp8`` (default: on CUDA) stay e4m3 in ``Fp8Linear``
    modules that dequantise per call, so V3's weights fit in FP8-sized memory.

    ``tensor_parallel`` loads only this rank's shard (model/parallel.py says what is split how). A split FP8
    weight stays e4m3 when its slice is whole 128×128 blocks (V3's at TP 8: the slice's e4m3 values and
    scale rows/columns are taken as they are); otherwise it is dequantised on the CPU and the dense copy is
    split, which is always exact and only costs memory on dims no real checkpoint has.

    ``pipeline`` loads only what that stage holds (model/pipeline.py): the checkpoint's other tensors are
    not read.
    """
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else config.torch_dtype
    if keep_fp8 is None:
        keep_fp8 = device.type == "cuda"
    tp = tensor_parallel or TensorParallel()
    stage = pipeline or PipelineStage.of(config, 0, 1)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, tp.size)
        strip_to_stage(model, stage)

    with open_checkpoint(path) as raw:
        if keep_fp8:
            quantised = {
                _module_name(n[: -len(".weight_scale_inv")] + ".weight", config)
                for n in raw
                if n.endswith(".weight_scale_inv")
            }
            modules = {n[: -len(".weight")] for n in quantised if n is not None and stage.holds(n, config)}
            if tp.size > 1:
                modules = {m for m in modules if _fp8_slice_is_whole_blocks(model, m, config)}
            with torch.device("meta"):
                swap_in_fp8_linears(model, modules, config.fp8_block_size)
        expected = dict(model.state_dict())
        state = _load_state(raw, config, expected, device, dtype, path, tp, stage)
    if config.tie_word_embeddings and "lm_head.weight" in expected and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    if config.scoring_func != "sigmoid":
        # V2's softmax router has no correction bias: ours stays zero, and is not read.
        for name in [n for n in missing if n.endswith(".gate.e_score_correction_bias")]:
            state[name] = torch.zeros(expected[name].shape, dtype=torch.float32, device=device)
        missing = sorted(set(expected) - set(state))
    unavailable = None
    if (
        missing
        and all(n.startswith("mtp.") for n in missing)
        and not any(n.startswith("mtp.") for n in state)
    ):
        # What transformers' save_pretrained writes for DeepseekV3ForCausalLM: config.json keeps
        # num_nextn_predict_layers but no MTP tensor is stored. The model serves; speculation is off.
        unavailable = (
            f"config.json declares num_nextn_predict_layers {config.num_nextn_predict_layers} but the"
            f" checkpoint ships no MTP tensors (model.layers.{config.num_hidden_layers}.*)"
        )
        log.warning("%s: %s; serving without speculative decoding", path, unavailable)
        model.mtp = nn.ModuleList()
        missing = []
    if missing:
        mtp = [n for n in missing if n.startswith("mtp.")]
        if mtp and len(mtp) == len(missing):
            raise ValueError(
                f"checkpoint {path} has a partial MTP layer: {len(mtp)} of its tensors are missing: "
                + ", ".join(_checkpoint_name(n, config) for n in mtp[:8])
                + (" ..." if len(mtp) > 8 else "")
            )
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.mtp_unavailable = unavailable
    return model.eval(), config


def _checkpoint_name(module_name: str, config: ModelConfig) -> str:
    """``mtp.{d}.rest`` back to the checkpoint's ``model.layers.{N + d}.rest``."""
    depth, _, rest = module_name[len("mtp.") :].partition(".")
    return f"model.layers.{config.num_hidden_layers + int(depth)}.{rest}"


def _fp8_slice_is_whole_blocks(model: DeepseekV3ForCausalLM, module: str, config: ModelConfig) -> bool:
    """Whether this rank's slice of FP8 linear ``module`` (already built at its sharded shape) is whole
    scale blocks along the split dimension; replicated modules always are."""
    dim = shard_dim(module + ".weight")
    if dim is None:
        return True
    local = model.get_submodule(module).weight.shape[dim]
    return local % config.fp8_block_size[dim] == 0


def _load_state(
    raw: dict[str, Callable[[], torch.Tensor]],
    config: ModelConfig,
    expected: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    path: Path,
    tp: TensorParallel,
    stage: PipelineStage,
) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    block = config.fp8_block_size
    for name, load in raw.items():
        target = _module_name(name, config)
        if target is None or not stage.holds(target, config):
            continue
        split = shard_dim(target) if tp.size > 1 else None
        if name.endswith("weight_scale_inv"):
            if target in expected:  # kept for an Fp8Linear (a split one only when its slice is whole blocks)
                scale = load() if split is None else shard(load(), split, tp)
                state[target] = scale.to(device=device, dtype=torch.float32)
            continue
        if target not in expected:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint {path}")
        scale_name = name[: -len("weight")] + "weight_scale_inv"
        want = torch.float32 if target.endswith(_FP32_SUFFIXES) else dtype
        if split is not None:
            tensor = _load_shard(load, raw.get(scale_name), expected[target].dtype, want, block, split, tp)
            tensor = tensor.to(device)
        else:
            tensor = _load_whole(load, raw.get(scale_name), expected[target].dtype, want, block, device)
        if tuple(tensor.shape) != tuple(expected[target].shape):
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} != expected {tuple(expected[target].shape)}"
            )
        state[target] = tensor
    return state


def _load_whole(
    load: Callable[[], torch.Tensor],
    load_scale: Callable[[], torch.Tensor] | None,
    param_dtype: torch.dtype,
    want: torch.dtype,
    block: tuple[int, int],
    device: torch.device,
) -> torch.Tensor:
    tensor = load().to(device)
    if param_dtype == torch.float8_e4m3fn:  # an Fp8Linear keeps the e4m3 weight
        return tensor.to(torch.float8_e4m3fn)
    if load_scale is not None:
        return dequantize_fp8_block(tensor, load_scale().to(device), block, want)
    return tensor.to(want)


def _load_shard(
    load: Callable[[], torch.Tensor],
    load_scale: Callable[[], torch.Tensor] | None,
    param_dtype: torch.dtype,
    want: torch.dtype,
    block: tuple[int, int],
    dim: int,
    tp: TensorParallel,
) -> torch.Tensor:
    """This rank's slice of a split weight, made on the CPU (only the slice goes to the device)."""
    tensor = load()
    if param_dtype == torch.float8_e4m3fn:  # whole-block slice: e4m3 values as stored
        return shard(tensor, dim, tp).to(torch.float8_e4m3fn)
    if load_scale is not None:  # dequantise the whole weight, then split: exact for any block alignment
        tensor = dequantize_fp8_block(tensor, load_scale(), block, want)
    return shard(tensor, dim, tp).to(want)
