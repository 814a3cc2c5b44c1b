"""A GGUF file of a (tiny) Llama-architecture causal LM folder, offline: what llama.cpp's server loads.

`python -m taskgate_local.tinygguf HF_FOLDER OUT.gguf` reads a transformers folder (config.json, model.safetensors,
the SentencePiece tokenizer.model and the chat template) and writes the same weights, vocabulary and template as a
float32 GGUF with the `gguf` package, as llama.cpp's own `convert_hf_to_gguf.py` does for a LlamaForCausalLM (that
script ships only in llama.cpp's sources, in no wheel): for the tiny chat model (taskgate_local/tinylm.py) the two
files hold the same tensors, tokens, scores and token types. The upstream backend's tests serve it with llama.cpp's
server.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """transformers' q/k rows in llama.cpp's rotary order (convert_hf_to_gguf.py LlamaModel.permute)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _vocab(folder: Path, size: int) -> tuple[list[bytes], list[float], list[int]]:
    """Tokens, scores and token types of the folder's SentencePiece tokenizer (convert_hf_to_gguf.py's sentencepiece
    path: the same three lists)."""
    from sentencepiece import SentencePieceProcessor

    if not (folder / "tokenizer.model").is_file():
        raise ValueError(f"{folder}: no SentencePiece tokenizer.model")
    sp = SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        kind = gguf.TokenType.NORMAL
        if sp.IsUnknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif sp.IsControl(i):
            kind = gguf.TokenType.CONTROL
        elif sp.IsUnused(i):
            kind = gguf.TokenType.UNUSED
        elif sp.IsByte(i):
            kind = gguf.TokenType.BYTE
        tokens.append(sp.IdToPiece(i).encode())
        scores.append(sp.GetScore(i))
        types.append(int(kind))
    while len(tokens) < size:  # the embedding may be wider than the tokenizer
        tokens.append(f"[PAD{len(tokens)}]".encode())
        scores.append(-1000.0)
        types.append(int(gguf.TokenType.UNUSED))
    return tokens, scores, types


def convert(folder: Path, out: Path) -> Path:
    """Writes `out` from the LlamaForCausalLM in `folder`; answers `out`."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("architectures", ["LlamaForCausalLM"])[0] != "LlamaForCausalLM":
        raise ValueError(f"{folder}: a LlamaForCausalLM is expected, not {config['architectures']}")
    heads, kv_heads = (
        int(config["num_attention_heads"]),
        int(config.get("num_key_value_heads") or config["num_attention_heads"]),
    )
    blocks, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name(folder.name)
    writer.add_block_count(blocks)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(
        float((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0)))
    )
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config["vocab_size"]))
    head_dim = int(config.get("head_dim") or hidden // heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens, scores, types = _vocab(folder, int(config["vocab_size"]))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    # bos/eos/unk/pad ids, add_bos_token and the chat template (tokenizer_config.json or chat_template.jinja)
    gguf.SpecialVocab(folder, load_merges=False, n_vocab=len(tokens)).add_to_gguf(writer)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, blocks)
    weights = load_file(folder / "model.safetensors")
    # tied embeddings leave lm_head out of the file, and llama.cpp then reads its output from token_embd
    for name, tensor in weights.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        data = tensor.astype(np.float32)
        if name.endswith("q_proj.weight"):
            data = _permute(data, heads)
        elif name.endswith("k_proj.weight"):
            data = _permute(data, kv_heads)
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"{folder}: no GGUF name for tensor {name}")
        writer.add_tensor(mapped, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a LlamaForCausalLM folder (save_pretrained)")
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    args = parser.parse_args()
    print(convert(args.folder, args.out))


if __name__ == "__main__":
    main()
