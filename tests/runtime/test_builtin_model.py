"""The packaged builtin:sovereign-tiny checkpoint: HF loading, real tensor names, MTP, template, accuracy."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sovereign_runtime.builtin import builtin_names, resolve, resolve_builtin, tasks
from sovereign_runtime.builtin import tokenizer as tok
from sovereign_runtime.builtin.train import RouterBalancer, build, load_mtp_layer, losses, make_batch
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM


@pytest.fixture(scope="module")
def path() -> Path:
    return resolve_builtin("sovereign-tiny")


@pytest.fixture(scope="module")
def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def config(path: Path) -> DeepseekV3Config:
    return DeepseekV3Config.from_pretrained(path)


@pytest.fixture(scope="module")
def model(path: Path) -> DeepseekV3ForCausalLM:
    m = DeepseekV3ForCausalLM.from_pretrained(path)
    return m.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(path)


def test_resolve_builtin_finds_packaged_checkpoint(path: Path) -> None:
    assert builtin_names() == ["sovereign-tiny"]
    assert resolve_builtin("builtin:sovereign-tiny") == path
    assert resolve is resolve_builtin  # the name the runtime CLI looks up
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    assert (path / "generation_config.json").is_file()
    # Package data must stay small enough to ship inside the wheel.
    assert sum(f.stat().st_size for f in path.iterdir()) < 12 * 2**20


@pytest.mark.parametrize("name", ["sovereign-huge", "builtin:nope", ""])
def test_resolve_builtin_rejects_unknown_names_listing_valid_ones(name: str) -> None:
    with pytest.raises(
        ValueError, match=r"unknown built-in model .*valid built-in models: builtin:sovereign-tiny"
    ):
        resolve_builtin(name)


def test_config_is_deepseek_v3_with_every_feature(path: Path, config: DeepseekV3Config) -> None:
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v3"
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"]
    assert raw["num_nextn_predict_layers"] == 1
    assert config.q_lora_rank is not None
    assert 0 < config.first_k_dense_replace < config.num_hidden_layers
    assert config.n_group > 1 and config.topk_group < config.n_group
    assert config.n_shared_experts == 1
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.torch_dtype == torch.float32 or raw.get("dtype") == "float32"


def test_safetensors_use_real_deepseek_v3_names(
    config: DeepseekV3Config, tensors: dict[str, torch.Tensor]
) -> None:
    moe_layer = config.first_k_dense_replace
    for name in [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
        "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        f"model.layers.{moe_layer}.mlp.gate.weight",
        f"model.layers.{moe_layer}.mlp.gate.e_score_correction_bias",
        f"model.layers.{moe_layer}.mlp.shared_experts.down_proj.weight",
        f"model.layers.{moe_layer}.mlp.experts.{config.n_routed_experts - 1}.up_proj.weight",
    ]:
        assert name in tensors, name
    assert all(t.dtype == torch.float32 for t in tensors.values())
    # The balancing rule left a real, nonzero correction bias for the runtime to honour.
    biases = [t for k, t in tensors.items() if k.endswith("e_score_correction_bias")]
    assert len(biases) == config.num_hidden_layers - config.first_k_dense_replace + 1  # + the MTP layer
    assert all(b.abs().max() > 0 for b in biases)


def test_mtp_layer_is_stored_under_v3_names(
    config: DeepseekV3Config, tensors: dict[str, torch.Tensor]
) -> None:
    prefix = f"model.layers.{config.num_hidden_layers}."
    h, v = config.hidden_size, config.vocab_size
    expected_shapes = {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,),
        "shared_head.head.weight": (v, h),
        "embed_tokens.weight": (v, h),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.kv_a_proj_with_mqa.weight": (config.kv_lora_rank + config.qk_rope_head_dim, h),
        "mlp.gate.weight": (config.n_routed_experts, h),
        "mlp.experts.0.gate_proj.weight": (config.moe_intermediate_size, h),
    }
    for name, shape in expected_shapes.items():
        assert tuple(tensors[prefix + name].shape) == shape, name
    assert not any(k.startswith(f"model.layers.{config.num_hidden_layers + 1}.") for k in tensors)


def test_hf_loads_every_main_weight_and_only_skips_mtp(path: Path, config: DeepseekV3Config) -> None:
    _, info = DeepseekV3ForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
    mtp_prefix = f"model.layers.{config.num_hidden_layers}."
    assert info["unexpected_keys"]
    assert all(k.startswith(mtp_prefix) for k in info["unexpected_keys"])


def test_chat_template_renders_deepseek_style(hf_tokenizer) -> None:
    q = tasks.Question(12, 345)
    rendered = hf_tokenizer.apply_chat_template(q.messages(), add_generation_prompt=True, tokenize=False)
    assert rendered == "<｜begin▁of▁sentence｜><｜User｜>What is 12 + 345?<｜Assistant｜>"
    assert rendered == tok.render_prompt(q.messages())  # training used the same template
    conversation = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "<think>1+2=3</think>3"},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    rendered = hf_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<｜begin▁of▁sentence｜>Add.<｜User｜>What is 1 + 2?<｜Assistant｜>3<｜end▁of▁sentence｜>"
        "<｜User｜>What is 2 + 2?<｜Assistant｜>"
    )
    assert hf_tokenizer.bos_token == tok.BOS and hf_tokenizer.eos_token == tok.EOS


def test_tokenizer_is_character_level_with_single_token_specials(hf_tokenizer) -> None:
    ids = hf_tokenizer.encode("<｜User｜>What is 1 + 2?<｜Assistant｜><think>", add_special_tokens=False)
    assert len(ids) == 1 + len("What is 1 + 2?") + 1 + 1
    assert ids[0] == hf_tokenizer.convert_tokens_to_ids(tok.USER)
    text = "<think>1+2=3</think>3"
    ids = hf_tokenizer.encode(text + tok.EOS, add_special_tokens=False)
    assert ids[-1] == hf_tokenizer.eos_token_id == 1
    # <think> tags survive skip_special_tokens so the server's reasoning parser can find them.
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_greedy_accuracy_on_held_out_questions(model: DeepseekV3ForCausalLM, hf_tokenizer) -> None:
    questions = tasks.make_questions(20, seed=2026)
    prompts = [
        hf_tokenizer.apply_chat_template(q.messages(), add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    enc = hf_tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=40, do_sample=False)
    texts = hf_tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    correct = sum(tasks.check_answer(q, t) for q, t in zip(questions, texts, strict=True))
    assert correct >= 19, list(zip(questions, texts, strict=True))
    # Completions carry the reasoning trace before the answer.
    assert sum(t.startswith("<think>") and "</think>" in t for t in texts) >= 19


def test_mtp_layer_predicts_the_token_after_next(
    path: Path,
    model: DeepseekV3ForCausalLM,
    config: DeepseekV3Config,
    tensors: dict[str, torch.Tensor],
    hf_tokenizer,
) -> None:
    mtp, embed, head = load_mtp_layer(path)
    prefix = f"model.layers.{config.num_hidden_layers}."
    # The per-expert split round-trips exactly.
    assert torch.equal(mtp.mlp.experts.down_proj[1], tensors[prefix + "mlp.experts.1.down_proj.weight"])
    assert torch.equal(embed, tensors["model.embed_tokens.weight"])

    total = hits = 0
    for q in tasks.make_questions(8, seed=7):
        prompt = hf_tokenizer.apply_chat_template(q.messages(), add_generation_prompt=True, tokenize=False)
        prompt_len = len(hf_tokenizer.encode(prompt, add_special_tokens=False))
        ids = torch.tensor(
            [hf_tokenizer.encode(prompt + tasks.completion_text(q) + tok.EOS, add_special_tokens=False)]
        )
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state
            positions = torch.arange(ids.shape[1] - 1).unsqueeze(0)
            pos_emb = model.model.rotary_emb(hidden, positions)
            logits = (
                mtp.mtp_forward(hidden[:, :-1], torch.nn.functional.embedding(ids[:, 1:], embed), pos_emb)
                @ head.T
            )
        # Position t predicts token t+2; score the assistant turn only.
        predicted = logits[0, prompt_len - 1 : -1].argmax(-1)
        target = ids[0, prompt_len + 1 :]
        hits += int((predicted == target).sum())
        total += target.numel()
    assert hits / total >= 0.95


def test_training_step_routes_gradients_and_balances_router_bias() -> None:
    torch.manual_seed(0)
    tokenizer = tok.build_tokenizer()
    model, mtp = build(seed=0, vocab_size=tokenizer.get_vocab_size())
    balancer = RouterBalancer([model, mtp], gamma=0.01)
    assert len(balancer.routers) == model.config.num_hidden_layers - model.config.first_k_dense_replace + 1
    ids, labels = make_batch(tokenizer, random.Random(0), 4, pad_id=tokenizer.token_to_id(tok.PAD))
    # Labels start at the assistant turn: the prompt is never supervised.
    assert (labels[:, :5] == -100).all()
    main, mtp_loss = losses(model, mtp, ids, labels)
    (main + mtp_loss).backward()
    for router in balancer.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0  # sigmoid gate learns
        assert router.e_score_correction_bias.grad is None  # the bias is not a gradient parameter
    before = [r.e_score_correction_bias.clone() for r in balancer.routers]
    balancer.step()
    for router, old in zip(balancer.routers, before, strict=True):
        delta = router.e_score_correction_bias - old
        assert all(abs(d) < 1e-7 or abs(abs(d) - 0.01) < 1e-7 for d in delta.tolist())
        assert delta.abs().sum() > 0  # some expert was over- or under-loaded
