"""The character-level tokenizer and DeepSeek-style chat template of `builtin:sovereign-tiny`.

Built with HF ``tokenizers``: a BPE model with no merges over printable ASCII plus newline (so every
character is one token), DeepSeek's special-token spellings for BOS/EOS/pad and the chat roles, and
``<think>``/``</think>`` as single non-special tokens (they survive ``skip_special_tokens`` the way
DeepSeek-R1's do, so a reasoning parser can find them in decoded text).
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import AddedToken, Tokenizer, decoders, models

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
UNK = "<｜unk｜>"

# Order fixes the ids: BOS=0 and EOS=1 as in DeepSeek-V3's config defaults.
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT, UNK]
NON_SPECIAL_ADDED = [THINK_OPEN, THINK_CLOSE]
CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n"]

# DeepSeek-R1 style: system text right after BOS, user turns behind <｜User｜>, assistant turns behind
# <｜Assistant｜> closed by EOS; earlier assistant turns drop their reasoning (text up to </think>).
CHAT_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + message['content'] %}{% endif %}{% endfor %}"
    "{{ bos_token }}{{ ns.system }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    + ASSISTANT
    + "{{ content }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + NON_SPECIAL_ADDED + CHARACTERS:
        vocab[tok] = len(vocab)
    # No pre-tokenizer: the whole text is one "word" and, with no merges, BPE emits one token per character.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED])
    return tok


def save_tokenizer_files(out: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def render_prompt(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Render the chat template with jinja2 exactly as HF does (used by training; no transformers needed)."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    return env.from_string(CHAT_TEMPLATE).render(
        messages=messages, bos_token=BOS, eos_token=EOS, add_generation_prompt=add_generation_prompt
    )
