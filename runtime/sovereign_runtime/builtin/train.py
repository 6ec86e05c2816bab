"""Train `builtin:sovereign-tiny` from scratch: ``python -m sovereign_runtime.builtin.train --out DIR``.

The main model is HF transformers' ``DeepseekV3ForCausalLM`` (our correctness oracle): MLA with a query
LoRA, YaRN rope, one dense layer then MoE layers (sigmoid router, groups, correction bias, shared
expert). On top sits one multi-token-prediction (MTP) layer laid out like DeepSeek-V3's
``model.layers.{num_hidden_layers}``: ``enorm``, ``hnorm``, ``eh_proj``, a full decoder layer,
``shared_head.norm``, ``shared_head.head`` (plus ``embed_tokens``). It is trained with the MTP objective:
from the main model's final (normed) hidden state at position t and the embedding of token t+1 it predicts
token t+2. Embedding and output head are shared with the main model during training, as in V3, and
written out as copies under the MTP names.

The router's ``e_score_correction_bias`` gets no gradient; it is steered by DeepSeek-V3's auxiliary-loss-free
balancing rule (bias += gamma * sign(mean load - expert load) after each step), so the shipped checkpoint
has a real, nonzero bias for the runtime to honour.

Everything is seeded; on the same torch build and thread count the run is reproducible.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3TopkRouter,
)

from sovereign_runtime.builtin import tasks
from sovereign_runtime.builtin import tokenizer as tok

MAX_POSITIONS = 256


def tiny_config(vocab_size: int) -> DeepseekV3Config:
    """The architecture of sovereign-tiny: every DeepSeek-V3 feature, at toy scale."""
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=MAX_POSITIONS,
        # YaRN as in V3 (factor over the original window, beta 32/1, mscale 1/1) at toy scale.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": MAX_POSITIONS // 2,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        num_nextn_predict_layers=1,
        attn_implementation="sdpa",
    )


class SharedHead(nn.Module):
    """``shared_head.norm`` and ``shared_head.head``; ``head`` is the main lm_head during training."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MTPLayer(DeepseekV3DecoderLayer):
    """DeepSeek-V3's MTP module: a decoder layer (same parameter names) plus its input/output adapters."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__(config, layer_idx=config.num_hidden_layers)
        self.enorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def mtp_forward(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """hidden[t] (main model, after its final norm) + embed(token t+1) -> normed state predicting t+2."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        x = self(x, attention_mask=None, position_embeddings=position_embeddings)
        return self.shared_head.norm(x)


def init_mtp(mtp: MTPLayer, std: float) -> None:
    for name, p in mtp.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, mean=0.0, std=std)
    for module in mtp.modules():
        if isinstance(module, DeepseekV3TopkRouter):
            nn.init.zeros_(module.e_score_correction_bias)


class RouterBalancer:
    """Auxiliary-loss-free load balancing: count expert picks per router, nudge the correction bias."""

    def __init__(self, modules: list[nn.Module], gamma: float) -> None:
        self.routers = [m for root in modules for m in root.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.gamma = gamma
        self.counts = [torch.zeros(r.num_experts) for r in self.routers]
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module: nn.Module, inputs: tuple, output: tuple) -> None:
            if module.training:
                idx = output[2].reshape(-1)
                self.counts[i] += torch.bincount(idx, minlength=self.counts[i].numel()).float()

        return hook

    @torch.no_grad()
    def step(self) -> None:
        for router, counts in zip(self.routers, self.counts, strict=True):
            router.e_score_correction_bias += self.gamma * torch.sign(counts.mean() - counts)
            counts.zero_()


def encode_example(tokenizer: object, question: tasks.Question) -> tuple[list[int], int]:
    """Token ids of prompt + completion + EOS, and the prompt length (loss starts after it)."""
    prompt = tok.render_prompt(question.messages(), add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt).ids  # type: ignore[attr-defined]
    completion_ids = tokenizer.encode(tasks.completion_text(question)).ids  # type: ignore[attr-defined]
    return prompt_ids + completion_ids + [1], len(prompt_ids)


def make_batch(
    tokenizer: object, rng: random.Random, batch_size: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and next-token labels (-100 outside the assistant turn)."""
    examples = [encode_example(tokenizer, tasks.sample_training_question(rng)) for _ in range(batch_size)]
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    for row, (seq, prompt_len) in enumerate(examples):
        ids[row, : len(seq)] = torch.tensor(seq)
        # labels[t] is the token at t+1; supervise only predictions of assistant tokens.
        labels[row, prompt_len - 1 : len(seq) - 1] = torch.tensor(seq[prompt_len:])
    return ids, labels


def losses(
    model: DeepseekV3ForCausalLM, mtp: MTPLayer, ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Main next-token loss and MTP (token t+2) loss on the same batch."""
    inner = model.model
    out = inner(input_ids=ids, use_cache=False)
    hidden = out.last_hidden_state  # after model.norm: the state lm_head reads, and what MTP consumes
    logits = model.lm_head(hidden)
    main = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    seq = ids.shape[1]
    positions = torch.arange(seq - 1).unsqueeze(0)
    pos_emb = inner.rotary_emb(hidden, positions)
    next_embeds = inner.embed_tokens(ids[:, 1:])
    mtp_hidden = mtp.mtp_forward(hidden[:, :-1], next_embeds, pos_emb)
    mtp_logits = model.lm_head(mtp_hidden)
    mtp_labels = labels[:, 1:]  # at t: token t+2
    mtp_loss = nn.functional.cross_entropy(mtp_logits.flatten(0, 1), mtp_labels.flatten(), ignore_index=-100)
    return main, mtp_loss


def build(seed: int, vocab_size: int) -> tuple[DeepseekV3ForCausalLM, MTPLayer]:
    torch.manual_seed(seed)
    config = tiny_config(vocab_size)
    model = DeepseekV3ForCausalLM(config)
    mtp = MTPLayer(config)
    init_mtp(mtp, config.initializer_range)
    return model, mtp


@torch.no_grad()
def greedy_accuracy(
    model: DeepseekV3ForCausalLM, hf_tokenizer: object, questions: list[tasks.Question]
) -> float:
    """Greedy accuracy with HF ``generate`` on chat-templated prompts (left-padded batches)."""
    model.eval()
    correct = 0
    for start in range(0, len(questions), 64):
        chunk = questions[start : start + 64]
        prompts = [
            hf_tokenizer.apply_chat_template(q.messages(), add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
            for q in chunk
        ]
        enc = hf_tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)  # type: ignore[operator]
        out = model.generate(**enc, max_new_tokens=48, do_sample=False)
        texts = hf_tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)  # type: ignore[attr-defined]
        correct += sum(tasks.check_answer(q, t) for q, t in zip(chunk, texts, strict=True))
    return correct / max(1, len(questions))


def mtp_state_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split HF's fused expert tensors into V3's per-expert names (``mlp.experts.{e}.gate_proj.weight``...).

    HF 5.x holds experts as ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]`` and
    converts them only for the modules it saves itself; the MTP layer is ours, so we split it here.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name == "mlp.experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"mlp.experts.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"mlp.experts.{e}.up_proj.weight"] = up[e].contiguous()
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def mtp_state_from_checkpoint(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Inverse of :func:`mtp_state_to_checkpoint`: fuse per-expert tensors back into HF's layout."""
    out = {k: v for k, v in state.items() if not k.startswith("mlp.experts.")}
    gate = [state[f"mlp.experts.{e}.gate_proj.weight"] for e in range(num_experts)]
    up = [state[f"mlp.experts.{e}.up_proj.weight"] for e in range(num_experts)]
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
    out["mlp.experts.down_proj"] = torch.stack(
        [state[f"mlp.experts.{e}.down_proj.weight"] for e in range(num_experts)]
    )
    return out


def load_mtp_layer(checkpoint: Path) -> tuple[MTPLayer, torch.Tensor, torch.Tensor]:
    """The checkpoint's MTP layer as an ``MTPLayer`` plus its own embedding and head weights."""
    config = DeepseekV3Config.from_pretrained(checkpoint)
    # A standalone module gets no dispatch from from_pretrained: pick the implementations HF would.
    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"
    prefix = f"model.layers.{config.num_hidden_layers}."
    tensors = load_file(str(Path(checkpoint) / "model.safetensors"))
    state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    embed, head = state.pop("embed_tokens.weight"), state.pop("shared_head.head.weight")
    mtp = MTPLayer(config)
    mtp.load_state_dict(mtp_state_from_checkpoint(state, config.n_routed_experts), strict=True)
    return mtp.eval(), embed, head


def save_checkpoint(out: Path, model: DeepseekV3ForCausalLM, mtp: MTPLayer) -> None:
    """HF ``save_pretrained`` for the main model, then the MTP tensors appended under their real names."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    for name, t in mtp_state_to_checkpoint(mtp.state_dict()).items():
        tensors[prefix + name] = t.detach().clone().contiguous()
    # V3 stores the MTP layer's own embedding and head; ours are trained shared, so write copies.
    tensors[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    tensors[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    generation = GenerationConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=2, do_sample=False, max_new_tokens=64
    )
    generation.save_pretrained(out)
    tok.save_tokenizer_files(out, model_max_length=MAX_POSITIONS)


def evaluate(checkpoint: Path, n: int, seed: int) -> int:
    """Score a saved checkpoint exactly as users load it: ``from_pretrained`` plus its chat template."""
    model = DeepseekV3ForCausalLM.from_pretrained(checkpoint)
    hf_tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    start = time.time()
    acc = greedy_accuracy(model, hf_tokenizer, tasks.make_questions(n, seed=seed))
    summary = {
        "checkpoint": str(checkpoint),
        "heldout_questions": n,
        "eval_seed": seed,
        "greedy_accuracy": acc,
    }
    print(json.dumps(summary | {"eval_seconds": round(time.time() - start, 1)}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="checkpoint folder to write (required unless --evaluate)")
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--mtp-weight", type=float, default=0.3, help="lambda of the MTP loss (V3: 0.1-0.3)")
    parser.add_argument("--bias-gamma", type=float, default=1e-3, help="router bias update speed")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared 2-core box")
    parser.add_argument("--eval-n", type=int, default=500, help="held-out questions scored at the end")
    parser.add_argument("--eval-seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="every N steps: save to --out and score 64 held-out questions",
    )
    parser.add_argument(
        "--evaluate",
        type=Path,
        metavar="CHECKPOINT",
        help="do not train: load CHECKPOINT with HF transformers and print its held-out greedy accuracy",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.evaluate is not None:
        return evaluate(args.evaluate, args.eval_n, args.eval_seed)
    if args.out is None:
        parser.error("--out DIR is required (or --evaluate CHECKPOINT)")
    random.seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = tok.build_tokenizer()
    pad_id = tokenizer.token_to_id(tok.PAD)
    model, mtp = build(args.seed, tokenizer.get_vocab_size())
    params = list(model.parameters()) + list(mtp.parameters())
    n_params = sum(p.numel() for p in params)
    print(f"parameters: {n_params / 1e6:.2f}M (main + MTP)", flush=True)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    balancer = RouterBalancer([model, mtp], gamma=args.bias_gamma)
    model.train()
    mtp.train()
    start = time.time()
    for step in range(args.steps):
        for group in optim.param_groups:
            group["lr"] = lr_at(step)
        ids, labels = make_batch(tokenizer, rng, args.batch_size, pad_id)
        main_loss, mtp_loss = losses(model, mtp, ids, labels)
        loss = main_loss + args.mtp_weight * mtp_loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        balancer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(
                f"step {step:5d}  loss {main_loss.item():.4f}  mtp {mtp_loss.item():.4f}  "
                f"lr {lr_at(step):.2e}  {time.time() - start:.0f}s",
                flush=True,
            )
        if args.eval_every and step > 0 and step % args.eval_every == 0:
            # Intermediate checkpoints let a long run on a busy machine be cut short without losing it.
            save_checkpoint(args.out, model, mtp)
            acc = greedy_accuracy(
                model, AutoTokenizer.from_pretrained(args.out), tasks.make_questions(64, 99)
            )
            print(f"step {step:5d}  held-out greedy accuracy (64, seed 99) {acc:.3f}", flush=True)
            model.train()
    train_s = time.time() - start

    save_checkpoint(args.out, model, mtp)
    hf_tokenizer = AutoTokenizer.from_pretrained(args.out)
    questions = tasks.make_questions(args.eval_n, seed=args.eval_seed)
    acc = greedy_accuracy(model, hf_tokenizer, questions)
    summary = {
        "train_seconds": round(train_s, 1),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "parameters": n_params,
        "heldout_questions": len(questions),
        "eval_seed": args.eval_seed,
        "greedy_accuracy": acc,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
