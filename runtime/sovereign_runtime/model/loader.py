"""Load an HF-format DeepSeek-V3 checkpoint (safetensors, real tensor names, optional FP8 block scales)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .deepseek_v3 import DeepseekV3ForCausalLM
from .fp8 import dequantize_fp8_block, swap_in_fp8_linears

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
) -> tuple[DeepseekV3ForCausalLM, ModelConfig]:
    """Build the model from ``path`` (config.json + safetensors) on ``device``.

    ``dtype`` defaults to the checkpoint's dtype on CPU and bf16 on GPU. FP8 block-quantised weights are
    dequantised to ``dtype`` at load time, or with ``keep_fp8`` (default: on CUDA) stay e4m3 in ``Fp8Linear``
    modules that dequantise per call, so V3's weights fit in FP8-sized memory.
    """
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else config.torch_dtype
    if keep_fp8 is None:
        keep_fp8 = device.type == "cuda"
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)

    with open_checkpoint(path) as raw:
        if keep_fp8:
            quantised = {
                _module_name(n[: -len(".weight_scale_inv")] + ".weight", config)
                for n in raw
                if n.endswith(".weight_scale_inv")
            }
            modules = {n[: -len(".weight")] for n in quantised if n is not None}
            with torch.device("meta"):
                swap_in_fp8_linears(model, modules, config.fp8_block_size)
        expected = dict(model.state_dict())
        state = _load_state(raw, config, expected, device, dtype, path)
    if config.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval(), config


def _load_state(
    raw: dict[str, Callable[[], torch.Tensor]],
    config: ModelConfig,
    expected: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    path: Path,
) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    block = config.fp8_block_size
    for name, load in raw.items():
        target = _module_name(name, config)
        if target is None:
            continue
        if name.endswith("weight_scale_inv"):
            if target in expected:  # kept for an Fp8Linear
                state[target] = load().to(device=device, dtype=torch.float32)
            continue
        if target not in expected:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint {path}")
        tensor = load().to(device)
        scale_name = name[: -len("weight")] + "weight_scale_inv"
        want = torch.float32 if target.endswith(_FP32_SUFFIXES) else dtype
        if expected[target].dtype == torch.float8_e4m3fn:  # an Fp8Linear keeps the e4m3 weight
            tensor = tensor.to(torch.float8_e4m3fn)
        elif scale_name in raw:
            tensor = dequantize_fp8_block(tensor, raw[scale_name]().to(device), block, want)
        else:
            tensor = tensor.to(want)
        if tuple(tensor.shape) != tuple(expected[target].shape):
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} != expected {tuple(expected[target].shape)}"
            )
        state[target] = tensor
    return state
