"""Builds a tiny random-weight chat model offline, for tests and local runs: a 2-layer LlamaForCausalLM (hidden size 64)
in safetensors, with a SentencePiece tokenizer trained here (`tokenizer.model`, and `tokenizer.json` from it) and a
Zephyr-style chat template.

The SentencePiece model is what llama.cpp's `convert_hf_to_gguf.py` reads for a Llama (its sentencepiece path), so
the same folder converts to a GGUF for an OpenAI-compatible server. Built at `<state_dir>/models/llama-tiny`
(`make tiny-model`, or `python -m taskgate_local.tinylm [--folder F]`).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
from pathlib import Path
from typing import Any

MODEL_NAME = "llama-tiny"

# Zephyr's template (HuggingFaceH4/zephyr-7b-beta), which llama.cpp's server also recognises by its markers.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + eos_token }}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    "{% endfor %}"
)

_WORDS_TEXT = (
    "the a an and of to in is it you that he was for on are with as his they be at one have this from or had by hot "
    "word but what some we can out other were all there when up use your how said each she which do their time if "
    "will way about many then them write would like so these her long make thing see him two has look more day could "
    "go come did number sound no most people my over know water than call first who may down side been now find any "
    "new work part take get place made live where after back little only round man year came show every good me give "
    "our under name very through just form sentence great think say help low line turn cause much mean before move "
    "right boy old too same tell does set three want air well also play small end put home read hand large add even "
    "land here must big high such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father code review diff function return value error test"
)
_WORDS = _WORDS_TEXT.split(" ")
VOCAB_SIZE = 600  # SentencePiece BPE pieces, the 256 byte-fallback pieces and <unk> <s> </s> among them


def _sentences(seed: int) -> list[str]:
    """A small deterministic corpus the tokenizer is trained on."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + rng.choice(".?!,")
        for _ in range(3000)
    ]


def train_tokenizer(seed: int = 0) -> bytes:
    """A serialized SentencePiece BPE model (byte fallback: any text encodes; <unk>=0, <s>=1, </s>=2)."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_sentences(seed)), model_writer=out, vocab_size=VOCAB_SIZE, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0, hard_vocab_limit=False,
        num_threads=1, minloglevel=2, split_digits=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity",
    )
    return out.getvalue()


def build_tiny_lm(folder: Path, seed: int = 0) -> Path:
    """Writes the tiny chat model to `folder` (replacing what is there) and returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(train_tokenizer(seed))
    tokenizer: Any = LlamaTokenizer.from_pretrained(str(folder))  # converts tokenizer.model into a fast tokenizer
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    # older readers (gguf's SpecialVocab before chat_template.jinja) look for the template in tokenizer_config.json
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2) + "\n")

    torch.manual_seed(seed)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    LlamaForCausalLM(model_config).save_pretrained(str(folder))
    return folder


def is_lm_folder(folder: Path) -> bool:
    """Whether `folder` holds a built model (its weights and tokenizer)."""
    return (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def main(argv: list[str] | None = None) -> int:
    from taskgate.config import load_settings

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--folder", type=Path, default=None, help="where to build (default: <state_dir>/models/llama-tiny)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = args.folder or load_settings().state_dir / "models" / MODEL_NAME
    build_tiny_lm(folder, args.seed)
    sys.stdout.write(f"built {folder}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
