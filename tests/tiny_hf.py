"""A tiny local Hugging Face model directory for data and export tests (nothing downloaded).

A word-level fast tokenizer over WORDS with ChatML-like special tokens and a chat template
(CHATML, or CHATML_TAGS with {% generation %} around assistant messages: both mark the same
characters), a generation_config.json, and the tiny-qwen3 preset's model, randomly initialised
and saved in FP32 with save_pretrained.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ["<unk>", "<eos>", "<pad>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant",
         "the", "cat", "sat", "on", "a", "mat", "dog", "ran", "to", "red", "big", "why", "because",
         "it", "was", "yes", "no", "hello", "hi", "you", "are", "good"]
SPECIAL = ["<unk>", "<eos>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_TAGS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
               "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
               "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PRESET = Path(__file__).parents[1] / "slidedp/presets/models/tiny-qwen3.json"


def save_tokenizer(d: Path, template: str | None = CHATML) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=SPECIAL[3:])
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(d)
    return d


def save_model(d: Path, template: str | None = CHATML, seed: int = 0) -> Path:
    """The tiny model directory: weights (FP32), config, tokenizer, generation_config."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    cfg = json.loads(PRESET.read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    model.save_pretrained(d)
    GenerationConfig(eos_token_id=4, pad_token_id=2, max_new_tokens=7).save_pretrained(d)
    save_tokenizer(d, template)
    return d


def conversation(words: list[str], turns: int, gen: torch.Generator) -> list[dict]:
    """A system message and `turns` user/assistant exchanges of 1-4 random words each."""
    def text():
        n = int(torch.randint(1, 5, (1,), generator=gen))
        return " ".join(words[int(i)] for i in torch.randint(len(words), (n,), generator=gen))

    msgs = [{"role": "system", "content": text()}]
    for _ in range(turns):
        msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
    return msgs


def chat_jsonl(path: Path, n: int, seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    words = WORDS[8:]
    lines = [json.dumps({"messages": conversation(words, 1 + i % 2, gen)}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def hub_cache(root: Path, repo: str, src: Path) -> Path:
    """A Hugging Face hub cache under `root` holding `src` as repo's main snapshot, laid out as
    huggingface_hub lays it (blobs by sha256, snapshot files symlinked to them, refs/main)."""
    import hashlib
    import os

    base = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "blobs").mkdir()
    for f in src.iterdir():
        blob = base / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    return snap
